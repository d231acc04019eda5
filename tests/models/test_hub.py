"""Hugging Face Hub ids in place of model directories (``scv_jax.models.hub``), offline: a cache laid out
as huggingface_hub lays it out (``hub_cache.py``), the loaders reading an id as its directory, revisions,
and the one-line errors."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import types

import jax
import numpy as np
import pytest
from flax import nnx

from scv_jax.models import load_eagle3, load_hf, load_tokenizer
from scv_jax.models.hf import eos_token_ids
from scv_jax.models.hub import HUB_FILES, checkpoint_dir
from scv_jax.serving.chat import load_chat_template
from tests.models.eagle3_fixtures.heads import BIN_HEAD, head_config
from tests.models.fixtures import tiny_model
from tests.models.hub_cache import COMMIT, cache_repo, offline_hub
from tests.models.test_eagle3 import TARGET

FIXTURES = pathlib.Path(__file__).resolve().parent / "hf_fixtures"
V2 = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub(monkeypatch, tmp_path) -> pathlib.Path:
    """An offline Hub cache holding org/tiny: the llama fixture at COMMIT (main), the qwen2 fixture with
    eos ids and a chat template at V2 (branch v2)."""
    cache = offline_hub(monkeypatch, tmp_path / "hub")
    cache_repo(cache, "org/tiny", FIXTURES / "llama")
    qwen2 = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2", qwen2)
    (qwen2 / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (qwen2 / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    cache_repo(cache, "org/tiny", qwen2, commit=V2, refs=("v2",))
    return cache


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model))]


def test_an_id_loads_as_its_directory(hub):
    assert checkpoint_dir("org/tiny") == hub / "models--org--tiny" / "snapshots" / COMMIT
    model, local = load_hf("org/tiny", dtype="float32"), load_hf(FIXTURES / "llama", dtype="float32")
    assert model.config == local.config
    for a, b in zip(_leaves(model), _leaves(local), strict=True):
        np.testing.assert_array_equal(a, b)
    text = "The capital of France is"
    assert load_tokenizer("org/tiny").encode(text) == load_tokenizer(FIXTURES / "llama").encode(text)
    assert eos_token_ids("org/tiny") == eos_token_ids(FIXTURES / "llama") == [2]


def test_revisions_name_a_branch_or_a_commit(hub):
    snapshots = hub / "models--org--tiny" / "snapshots"
    assert checkpoint_dir("org/tiny", revision="v2") == checkpoint_dir("org/tiny", revision=V2) == snapshots / V2
    assert checkpoint_dir("org/tiny", revision=COMMIT) == checkpoint_dir("org/tiny", revision="main") == \
        snapshots / COMMIT
    assert load_hf("org/tiny", revision="v2", dtype="float32").config == \
        load_hf(FIXTURES / "qwen2", dtype="float32").config
    assert load_tokenizer("org/tiny", revision="v2").source == snapshots / V2 / "tokenizer.json"
    assert eos_token_ids("org/tiny", revision="v2") == [5, 7]
    assert load_chat_template("org/tiny", revision="v2").render([{"role": "user", "content": "hi"}]) == "hi!"
    assert load_chat_template("org/tiny") is None


@pytest.mark.parametrize("path_or_id, revision, message", [
    ("org/missing", None, "org/missing is not a local directory and not (completely) in the Hugging Face cache at "
                          "{cache}, and HF_HUB_OFFLINE is set"),
    ("org/tiny", "v3", "org/tiny at revision 'v3' is not a local directory and not (completely) in the Hugging "
                       "Face cache at {cache}, and HF_HUB_OFFLINE is set"),
])
def test_an_id_not_in_the_cache_offline(hub, path_or_id, revision, message):
    with pytest.raises(FileNotFoundError) as error:
        checkpoint_dir(path_or_id, revision=revision)
    assert str(error.value) == message.format(cache=hub)


def _http_error(cls):
    return cls("from the Hub", response=types.SimpleNamespace(headers={}, request=None))


@pytest.mark.parametrize("error, kind, message", [
    ("GatedRepoError", PermissionError, "org/tiny is a gated Hugging Face Hub repository: accept its terms on "
                                        "https://huggingface.co/org/tiny and log in"),
    ("RepositoryNotFoundError", FileNotFoundError,
     "org/tiny is neither a local directory nor a model on the Hugging Face Hub (a private one needs a login or "
     "HF_TOKEN)"),
    ("RevisionNotFoundError", FileNotFoundError, "org/tiny has no revision 'v9' on the Hugging Face Hub"),
    ("LocalEntryNotFoundError", FileNotFoundError,
     "org/tiny at revision 'v9' is not a local directory and not (completely) in the Hugging Face cache at {cache}, "
     "and the Hugging Face Hub cannot be reached"),
])
def test_hub_errors_are_one_line_naming_the_id(hub, monkeypatch, error, kind, message):
    import huggingface_hub
    from huggingface_hub import constants, utils

    cls = getattr(utils, error)
    raised = cls("not cached") if error == "LocalEntryNotFoundError" else _http_error(cls)

    def snapshot_download(*args, **kwargs):
        raise raised
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)       # online, but the Hub did not answer
    with pytest.raises(kind) as caught:
        checkpoint_dir("org/tiny", revision="v9")
    assert str(caught.value).startswith(message.format(cache=hub)) and "\n" not in str(caught.value)


def test_a_file_missing_from_the_snapshot_is_the_loaders_error(hub):
    snapshot = hub / "models--org--tiny" / "snapshots" / COMMIT
    (snapshot / "config.json").unlink()
    (snapshot / "tokenizer.json").unlink()
    where = re.escape(str(snapshot))
    with pytest.raises(FileNotFoundError, match=f"^load_hf: {where}/config.json not found$"):
        load_hf("org/tiny")
    with pytest.raises(FileNotFoundError, match=f"^load_tokenizer: {where}/tokenizer.json not found$"):
        load_tokenizer("org/tiny")


def test_paths_that_are_not_directories(hub, tmp_path):
    (hub / "models--org--tiny").rename(hub / "models--x--y")      # cached, but never looked up as an id
    for path in (tmp_path / "missing", "./missing", "a/b/c", "/no/such/dir", pathlib.Path("x/y")):
        with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(pathlib.Path(path)))} not found$"):
            checkpoint_dir(path)
    with pytest.raises(FileNotFoundError, match="config.json is not a directory"):
        checkpoint_dir(FIXTURES / "llama" / "config.json")
    with pytest.raises(ValueError, match="llama is a local directory: a revision \\('v2'\\) applies to Hub ids only"):
        checkpoint_dir(FIXTURES / "llama", revision="v2")
    assert checkpoint_dir(str(FIXTURES / "llama")) == FIXTURES / "llama"


def test_hub_files_are_what_the_loaders_read():
    """Every file of every fixture the loaders read is fetched (an EAGLE-3 head's pytorch_model.bin
    too); test-only files and a second copy of the weights (Mistral's consolidated.safetensors) are not."""
    from huggingface_hub.utils import filter_repo_objects

    names = {file.name for file in FIXTURES.glob("*/*")} | {"tokenizer_config.json", "consolidated.safetensors",
                                                            "README.md", "original/model.pth", "pytorch_model.bin"}
    fetched = set(filter_repo_objects(names, allow_patterns=list(HUB_FILES)))
    assert fetched == names - {"expected.json", "logits.npz", "hidden_states.npz", "consolidated.safetensors",
                               "README.md", "original/model.pth"}


def test_load_eagle3_reads_an_id(hub, tmp_path):
    """An EAGLE-3 head (pytorch_model.bin) loads from its Hub id at a revision as from its directory."""
    head = tmp_path / "head"
    head.mkdir()
    shutil.copy(FIXTURES.parent / "eagle3_fixtures" / "eagle3_head.bin", head / "pytorch_model.bin")
    (head / "config.json").write_text(json.dumps(head_config(**BIN_HEAD)))
    cache_repo(hub, "org/head", head, refs=("v1",))
    target = tiny_model(TARGET)
    by_id, local = load_eagle3("org/head", target, revision="v1"), load_eagle3(head, target)
    assert by_id.config == local.config and by_id.embed is target.embed
    for a, b in zip(_leaves(by_id), _leaves(local), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="^org/head is not a local directory .* HF_HUB_OFFLINE is set$"):
        load_eagle3("org/head", target)      # no main
