"""Training EAGLE-3 heads (scv_jax.eagle3_train): the TTT loss lines up with decoding, training lowers
it, the checkpoint round-trips through load_eagle3, the draft vocabulary is the most frequent ids, the
command's mistakes are one line, and the shipped demo head drafts losslessly for the demo target."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scv_jax import DecoderConfig, SpeculativeDecoder, cli
from scv_jax.eagle3_train import (STEP_WEIGHT, draft_vocabulary, initial_head, main, new_head, read_tokens,
                                  train_head, ttt_loss)
from scv_jax.models import load_demo, load_demo_head, load_eagle3, save_eagle3
from tests.models.fixtures import TINY, tiny_model
from tests.test_cli import BYTE_TARGET

AUX = (0, 1, 1)


@pytest.fixture(scope="module")
def target():
    return tiny_model(TINY, seed=0)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 9)), jnp.int32)


def test_the_ttt_loss_is_decodings_chain_of_drafts(target, tokens):
    """Step j's row t must see what the decoder's j-th draft after position p = t - j sees: the target's
    features of rows 0 .. p, then its own hidden_out of the row before (one dense call per draft, each
    appending the last call's hidden_out at its last row)."""
    head = new_head(target, draft_to_target=None, aux_layers=AUX, seed=1)
    sequences = tokens[:, :6]
    logits, taps = target(sequences, aux_layers=AUX)
    steps, rows = 3, sequences.shape[1] - 1

    @jax.jit
    def direct() -> jax.Array:
        ids, hidden, target_p = sequences[:, 1:], head.combine(taps[:, :-1]), jax.nn.softmax(logits[:, 1:], -1)
        total = 0.0
        for j in range(steps):
            losses = []
            for t in range(j, rows):
                p = t - j
                rows_hidden = hidden[:, :p + 1]
                out_logits, out = head(ids[:, :p + 1], rows_hidden)
                for i in range(1, j + 1):
                    rows_hidden = jnp.concatenate([rows_hidden, out[:, -1:]], axis=1)
                    out_logits, out = head(ids[:, :p + 1 + i], rows_hidden)
                losses.append(-jnp.sum(target_p[:, t] * jax.nn.log_softmax(out_logits[:, -1]), -1))
            total += STEP_WEIGHT ** j * jnp.mean(jnp.stack(losses))
        return total

    loss, agreement = jax.jit(lambda: ttt_loss(head, sequences, taps, logits, steps))()
    np.testing.assert_allclose(loss, direct(), rtol=1e-5)
    assert agreement.shape == (steps,)


def test_training_lowers_the_loss_and_the_checkpoint_round_trips(target, tokens, tmp_path):
    d2t, _ = draft_vocabulary(np.asarray(tokens).ravel(), TINY.vocab_size, 10)
    head = new_head(target, draft_to_target=np.arange(10) + d2t, aux_layers=AUX, seed=2)
    batches = [np.asarray(tokens)] * 30
    losses = []
    train_head(head, target, batches, optax.adam(1e-2), ttt_steps=2, on_step=lambda s, loss, a: losses.append(loss))
    assert losses[-1] < 0.7 * losses[0]
    loaded = load_eagle3(save_eagle3(head, tmp_path / "head", dtype="float32"), target, dtype="float32")
    hidden = head.combine(target(tokens, aux_layers=AUX)[1])
    np.testing.assert_allclose(loaded(tokens, hidden)[0], head(tokens, hidden)[0], rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 10
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    # --init continues from it: the same head, its vocabulary and aux layers kept
    resumed = initial_head(tmp_path / "head", target, draft_vocab_size=10, aux_layers=AUX)
    np.testing.assert_allclose(resumed(tokens, hidden)[0], head(tokens, hidden)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"--draft-vocab-size 12 differs from --init .*head's 10"):
        initial_head(tmp_path / "head", target, draft_vocab_size=12)
    with pytest.raises(ValueError, match=r"--aux-layers \[0, 0, 1\] differ from --init .*head's \[0, 1, 1\]"):
        initial_head(tmp_path / "head", target, aux_layers=(0, 0, 1))


def test_the_draft_vocabulary_is_the_most_frequent_ids():
    tokens = np.array([5, 5, 5, 2, 2, 9, 9, 9, 9, 7, 1])
    d2t, t2d = draft_vocabulary(tokens, 12, 3)
    assert (np.arange(3) + d2t).tolist() == [2, 5, 9]          # draft ids in increasing target id
    assert np.flatnonzero(t2d).tolist() == [2, 5, 9] and t2d.shape == (12,)
    d2t, t2d = draft_vocabulary(tokens, 12, 12)
    assert not d2t.any() and t2d.all()                         # the whole vocabulary: the identity
    with pytest.raises(ValueError, match="--draft-vocab-size must be in"):
        draft_vocabulary(tokens, 12, 13)


def test_data_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ab"}\n\n{"text": "c"}\n')
    assert read_tokens(tmp_path / "a.jsonl", None).tolist() == [97, 98, 99]
    assert read_tokens(tmp_path / "a.jsonl", lambda text: [len(text)]).tolist() == [2, 1]
    (tmp_path / "bad.jsonl").write_text('{"txt": "ab"}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl:1 is not an object with a string "text"'):
        read_tokens(tmp_path / "bad.jsonl", None)


@pytest.mark.parametrize("flags, message", [
    (["--data", "missing.txt"], "--data missing.txt is not a file"),
    (["--steps", "0"], "argument --steps: must be an int >= 1, got '0'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--aux-layers", "1,2"], "argument --aux-layers: must be 3 layer ids i,j,l, got '1,2'"),
    (["--aux-layers", "1,2,9"], "--aux-layers must be 3 layer ids in [0, 6), got [1, 2, 9]"),
    (["--draft-vocab-size", "300"], "--draft-vocab-size must be in [1, 256]"),
    (["--seq-len", "100"], "--seq-len 100 needs more than the data's 5 tokens"),
    (["--init", "no-such-dir"], "--init: "),
])
def test_command_mistakes_are_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "data.txt").write_text("hello")
    args = {"--target": "demo", "--data": str(tmp_path / "data.txt"), "--out": str(tmp_path / "out")}
    args.update(dict(zip(flags[::2], flags[1::2])))
    try:
        code = main([x for pair in args.items() for x in pair])
    except SystemExit as e:          # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_demo_command_drafts_with_the_head(monkeypatch, capsys):
    target = tiny_model(BYTE_TARGET, seed=0)
    head = new_head(target, draft_to_target=None, aux_layers=(0, 0, 0), seed=0)
    monkeypatch.setattr("scv_jax.models.load_demo", lambda: (target, target))
    monkeypatch.setattr("scv_jax.models.load_demo_head", lambda model: head if model is target else None)
    assert cli.main(["demo", "--eagle3", "--max-new-tokens", "6", "--k", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative (k=2, EAGLE-3 head)" in out and "greedy outputs identical  yes" in out
    with pytest.raises(SystemExit):
        cli.main(["demo", "--eagle3", "--ngram"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_the_shipped_demo_head_drafts_the_targets_greedy_text():
    target, _ = load_demo()
    config = DecoderConfig(k=4, max_seq_len=64, num_blocks=16, batch_buckets=(1,))
    prompt = [list(b"import os\n\ndef ")]
    head = load_demo_head(target)         # bfloat16 by default, over the float32 target
    assert head.fc.kernel[...].dtype == jnp.bfloat16 and target.embed.embedding[...].dtype == jnp.float32
    assert load_demo_head(target, dtype="float32").fc.kernel[...].dtype == jnp.float32
    out = SpeculativeDecoder(target, head, config=config).generate(prompt, 24)
    assert out.tokens == SpeculativeDecoder(target, None, config=config).generate(prompt, 24).tokens
    assert out.stats.mean_accepted_length > 1.5
