"""Checkpoints named by a local directory or a Hugging Face Hub id (``org/name``), as vLLM takes them.

    checkpoint_dir("/models/Llama-3.2-1B")                    # a local directory, returned as it is
    checkpoint_dir("meta-llama/Llama-3.2-1B", revision="main")  # downloaded, or found in the cache

An id is resolved with ``huggingface_hub.snapshot_download``, which honours its cache and environment
(``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``); only the files the loaders read are
fetched. Errors are one line and name the id.
"""

from __future__ import annotations

import os
import pathlib

# What load_hf, load_eagle3, eos_token_ids, load_tokenizer and load_chat_template read: the config, the
# weights (model.safetensors, or the index and the shards transformers names
# model-0000i-of-0000n.safetensors; not e.g. Mistral's consolidated.safetensors, a second copy; an
# EAGLE-3 head's pytorch_model.bin), the tokenizer and its chat template.
HUB_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json")


def _is_repo_id(path_or_id: str | os.PathLike) -> bool:
    """Whether ``path_or_id`` is a ``str`` of the form of a Hub id: ``name`` or ``org/name`` (not a path
    such as ``./x``; a ``pathlib.Path`` is never an id)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path_or_id)     # HFValidationError for a non-str too
    except HFValidationError:
        return False
    return True


def checkpoint_dir(path_or_id: str | os.PathLike, *, revision: str | None = None) -> pathlib.Path:
    """The local directory of a checkpoint: ``path_or_id`` itself when it is a directory, else the Hub
    snapshot of the id ``path_or_id`` (a ``str``) at ``revision`` (a branch, tag or commit hash; None:
    the default branch), downloaded or found in the cache.

    Raises FileNotFoundError (a path that is not a directory, an unknown repository or revision, an id
    not cached while offline), PermissionError (a gated repository) or ValueError (a revision for a
    local directory), each in one line naming ``path_or_id``.
    """
    path = pathlib.Path(path_or_id)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"{path} is a local directory: a revision ({revision!r}) applies to Hub ids only")
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is not a directory (a model directory or a Hugging Face Hub id)")
    if not _is_repo_id(path_or_id):
        raise FileNotFoundError(f"{path} not found")
    return _snapshot(path_or_id, revision)


def _snapshot(repo_id: str, revision: str | None) -> pathlib.Path:
    """``snapshot_download`` of the files the loaders read, its errors made one line naming the id."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    try:
        return pathlib.Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except GatedRepoError:     # a RepositoryNotFoundError: first
        raise PermissionError(f"{repo_id} is a gated Hugging Face Hub repository: accept its terms on "
                              f"https://huggingface.co/{repo_id} and log in (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id} is neither a local directory nor a model on the Hugging Face Hub "
                                "(a private one needs a login or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
        at = f" at revision {revision!r}" if revision is not None else ""
        raise FileNotFoundError(f"{repo_id}{at} is not a local directory and not (completely) in the Hugging Face "
                                f"cache at {constants.HF_HUB_CACHE}, and {why}") from None
