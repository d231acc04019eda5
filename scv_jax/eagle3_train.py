"""Train an EAGLE-3 draft head for a target, in JAX, with training-time test (TTT):

    python -m scv_jax.eagle3_train --target demo --data corpus.txt --out /tmp/head \\
        [--steps 300 --batch 8 --seq-len 128 --lr 3e-3 --ttt-steps 3 --draft-vocab-size V \\
         --seed 0 --aux-layers i,j,l --init DIR]

``--target``: a ``load_hf`` directory (or Hub id) or ``demo`` (the shipped byte-level demo target).
``--data``: a UTF-8 text file, or a ``.jsonl`` file of ``{"text": ...}`` objects (the documents are
concatenated), tokenized with the checkpoint's tokenizer (the demo target: bytes). Writes an EAGLE-3
checkpoint (``config.json`` + ``model.safetensors``, what ``load_eagle3``, vLLM and SGLang read) to
``--out``. ``--init DIR`` continues from an EAGLE-3 checkpoint of this target (its vocabulary and aux
layers kept), e.g. to fine-tune with more ``--ttt-steps``. Guide: docs/eagle3.md, "Training a head".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from scv_jax.arguments import OneLineParser
from scv_jax.models import Eagle3Head, Transformer, load_demo, load_eagle3, load_hf, load_tokenizer, save_eagle3
from scv_jax.models.attention import grouped_query_attention

STEP_WEIGHT = 0.8      # SafeAILab's weight of TTT step j's loss: STEP_WEIGHT ** j


def read_tokens(path: str | pathlib.Path, encode: Callable[[str], list[int]] | None) -> np.ndarray:
    """int32[N]: the tokens of a text file or of a ``.jsonl`` file's ``"text"`` fields (concatenated);
    ``encode`` None reads bytes (the demo target's tokens)."""
    path = pathlib.Path(path)
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data: {path}:{number} is not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'--data: {path}:{number} is not an object with a string "text"')
            texts.append(record["text"])
    else:
        texts = [path.read_text(encoding="utf-8")]
    ids = [i for text in texts for i in (encode(text) if encode else text.encode("utf-8"))]
    return np.asarray(ids, np.int32)


def draft_vocabulary(tokens: np.ndarray, vocab_size: int, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's vocabulary maps for the ``draft_vocab_size`` most frequent ids of ``tokens`` (ties and
    unseen ids: lowest id first), draft ids in increasing target id: ``d2t`` int64[draft_vocab_size]
    (target id of draft id i = i + d2t[i]) and ``t2d`` bool[vocab_size] (the target ids kept)."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab_size}] (the target's vocabulary), "
                         f"got {draft_vocab_size}")
    counts = np.bincount(tokens, minlength=vocab_size)
    kept = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    return (kept - np.arange(draft_vocab_size)).astype(np.int64), np.isin(np.arange(vocab_size), kept)


def new_head(target: Transformer, *, draft_to_target: np.ndarray | None,
             aux_layers: tuple[int, int, int] | None = None, seed: int = 0) -> Eagle3Head:
    """A randomly initialised head for ``target`` (its hidden size, heads and MLP width, its dtype, its
    embedding shared), over ``draft_to_target`` (the draft ids' target ids; None: the target's
    vocabulary) and the taps of ``aux_layers`` (default EAGLE-3's: 2, L // 2, L - 3)."""
    layers = target.config.num_layers
    aux = aux_layers if aux_layers is not None else (min(2, layers - 1), layers // 2, max(layers - 3, 0))
    if len(aux) != 3 or not all(0 <= i < layers for i in aux):
        raise ValueError(f"--aux-layers must be 3 layer ids in [0, {layers}), got {list(aux)}")
    config = dataclasses.replace(target.config, num_layers=1, tie_embeddings=False, qkv_bias=False,
                                 qk_norm=False, sliding_window=None, sliding_layers=None, attention_sinks=False,
                                 attention_out_bias=False, num_experts=0, moe_bias=False, swiglu_limit=None)
    draft_vocab = config.vocab_size if draft_to_target is None else len(draft_to_target)
    return Eagle3Head(config, target.embed, draft_vocab_size=draft_vocab, draft_to_target=draft_to_target,
                      aux_layers=tuple(aux), norm_before_residual=False, rngs=nnx.Rngs(seed))


def initial_head(path: str | pathlib.Path, target: Transformer, *, draft_vocab_size: int | None = None,
                 aux_layers: tuple[int, int, int] | None = None) -> Eagle3Head:
    """The float32 head of the EAGLE-3 checkpoint at ``path`` to continue training from (``--init``);
    ``draft_vocab_size`` / ``aux_layers``, when given, must be the checkpoint's (ValueError naming the flag)."""
    try:
        head = load_eagle3(path, target, dtype="float32")
    except (ValueError, OSError) as error:
        raise type(error)(f"--init: {error}") from None
    size = head.lm_head.out_features
    if draft_vocab_size is not None and draft_vocab_size != size:
        raise ValueError(f"--draft-vocab-size {draft_vocab_size} differs from --init {path}'s {size}")
    if aux_layers is not None and tuple(aux_layers) != head.aux_layers:
        raise ValueError(f"--aux-layers {list(aux_layers)} differ from --init {path}'s {list(head.aux_layers)}")
    return head


def _ttt_attention(keys: list[jax.Array], values: list[jax.Array]) -> Callable:
    """``attend`` of TTT step j = len(keys) (keys, values: steps 0 .. j - 1's, [B, R, kv_heads, D]): row
    t, the j-th draft after the verified position p = t - j, sees step 0's rows 0 .. p (the target's
    features) and step i's row p + i for 0 < i <= j (its own earlier drafts), as when decoding."""
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        j, (batch, rows) = len(keys), q.shape[:2]
        row = jnp.arange(rows)

        def visible(steps: list[jax.Array]) -> jax.Array:     # [B, (j + 1) R, kv_heads, D]
            padded = [jnp.pad(x, ((0, 0), (j - i, 0), (0, 0), (0, 0)))[:, :rows]     # row t: x's row t - j + i
                      for i, x in enumerate(steps[1:], 1)]
            return jnp.concatenate([steps[0], *padded], axis=1)

        mask = jnp.concatenate([row[None, :] <= row[:, None] - j]
                               + [jnp.diag(row >= j - i) for i in range(1, j + 1)], axis=1)
        return grouped_query_attention(q, visible(keys + [k]), visible(values + [v]),
                                       jnp.broadcast_to(mask, (batch, rows, rows * (j + 1))))

    return attend


def ttt_loss(head: Eagle3Head, tokens: jax.Array, taps: jax.Array, target_logits: jax.Array,
             ttt_steps: int) -> tuple[jax.Array, jax.Array]:
    """The head unrolled ``ttt_steps`` draft steps over a batch of target forwards.

    tokens int32[B, T], taps [B, T, 3 * d_model] and target_logits float32[B, T, vocab] (the frozen
    target's). Row t pairs feature t with token t + 1 and is scored against the target's distribution of
    token t + 2 restricted to the draft vocabulary (softmax of ``target_logits[:, t + 1]`` over the draft
    ids); step j + 1's hidden at row t is step j's hidden_out at row t - 1 (the draft step before), its
    rows attend as in decoding (``_ttt_attention``); step j counts rows t >= j whose target argmax is in
    the draft vocabulary and weighs ``STEP_WEIGHT ** j``.
    Returns (the weighted sum of the steps' soft cross-entropies, float32[ttt_steps] top-1 agreement with
    the target per step).
    """
    vocab = head.config.vocab_size
    draft_ids = jnp.arange(vocab) if head.draft_to_target is None else head.draft_to_target[...]
    token_ids, logits_next = tokens[:, 1:], target_logits[:, 1:]
    target_p = jax.nn.softmax(logits_next[..., draft_ids], axis=-1)
    in_vocab = jnp.zeros(vocab, bool).at[draft_ids].set(True)[jnp.argmax(logits_next, -1)]
    rows = token_ids.shape[1]
    positions = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), token_ids.shape)
    hidden = head.combine(taps[:, :-1])
    keys, values, total, agreement = [], [], 0.0, []
    for j in range(ttt_steps):
        logits, hidden_out, k, v = head.forward_rows(token_ids, hidden, positions, _ttt_attention(keys, values))
        keys, values = keys + [k], values + [v]
        logp = jax.nn.log_softmax(logits[..., draft_ids], axis=-1)
        mask = in_vocab & (jnp.arange(rows) >= j)
        count = jnp.maximum(mask.sum(), 1)
        total = total + STEP_WEIGHT ** j * -jnp.sum(mask * jnp.sum(target_p * logp, -1)) / count
        agreement.append(jnp.sum(mask & (jnp.argmax(logp, -1) == jnp.argmax(target_p, -1))) / count)
        hidden = jnp.concatenate([hidden[:, :1], hidden_out[:, :-1]], axis=1)
    return total, jnp.stack(agreement)


def _trainable(path: tuple, value) -> bool:
    return isinstance(value, nnx.Param) and "embed" not in path       # the target's embedding stays frozen


def train_head(head: Eagle3Head, target: Transformer, batches: Iterable[np.ndarray],
               optimizer: optax.GradientTransformation, *, ttt_steps: int = 3,
               on_step: Callable[[int, float, np.ndarray], None] | None = None) -> tuple[float, np.ndarray]:
    """Trains ``head`` in place on ``batches`` (int32[B, T] each) with ``ttt_loss``, the target frozen
    (its features and logits computed on the fly, no gradient). ``on_step(step, loss, agreement)``
    follows each step (1-based). Returns the last step's (loss, agreement float32[ttt_steps])."""
    graphdef, params, frozen = nnx.split(head, _trainable, ...)
    target_graphdef, target_state = nnx.split(target)

    @jax.jit
    def update(params, opt_state, frozen, target_state, tokens):
        logits, taps = jax.lax.stop_gradient(
            nnx.merge(target_graphdef, target_state)(tokens, aux_layers=head.aux_layers))

        def loss(params):
            return ttt_loss(nnx.merge(graphdef, params, frozen), tokens, taps, logits, ttt_steps)

        (value, agreement), grads = jax.value_and_grad(loss, has_aux=True)(params)
        changes, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, changes), opt_state, value, agreement

    opt_state, result = optimizer.init(params), (float("nan"), np.zeros(ttt_steps))
    for step, batch in enumerate(batches, 1):
        params, opt_state, value, agreement = update(params, opt_state, frozen, target_state, jnp.asarray(batch))
        result = float(value), np.asarray(agreement)
        if on_step is not None:
            on_step(step, *result)
    nnx.update(head, params)
    return result


def random_batches(tokens: np.ndarray, *, steps: int, batch: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """``steps`` int32[batch, seq_len] windows of ``tokens`` at random offsets (ValueError at once if
    ``tokens`` is too short)."""
    if len(tokens) <= seq_len:
        raise ValueError(f"--seq-len {seq_len} needs more than the data's {len(tokens)} tokens")
    rng = np.random.default_rng(seed)
    return (np.stack([tokens[s:s + seq_len] for s in rng.integers(0, len(tokens) - seq_len + 1, size=batch)])
            for _ in range(steps))


def default_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW (weight decay 0.01), gradients clipped to global norm 0.5, the learning rate warmed up over
    5% of ``steps`` then cosine-decayed to 10%."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps, lr / 10)
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.01))


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (np.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _aux_layers(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be 3 layer ids i,j,l, got {text!r}")
    return tuple(int(p) for p in parts)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m scv_jax.eagle3_train", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a load_hf directory or Hub id, or 'demo'")
    parser.add_argument("--data", required=True, type=pathlib.Path, help="a text file or a .jsonl of {'text': ...}")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="the checkpoint directory to write")
    parser.add_argument("--steps", type=_int_at_least(1), default=300, help="optimizer steps")
    parser.add_argument("--batch", type=_int_at_least(1), default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=_int_at_least(1), default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    parser.add_argument("--ttt-steps", type=_int_at_least(1), default=3, help="draft steps unrolled per row")
    parser.add_argument("--draft-vocab-size", type=_int_at_least(1), help="default: the target's vocabulary")
    parser.add_argument("--seed", type=_int_at_least(0), default=0, help="initialisation and batch seed")
    parser.add_argument("--aux-layers", type=_aux_layers, help="the 3 tapped layers (default 2, L//2, L-3)")
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="saved weights")
    parser.add_argument("--init", type=pathlib.Path,
                        help="an EAGLE-3 checkpoint of this target to continue from (its vocabulary and aux layers)")
    parser.add_argument("--log-every", type=_int_at_least(1), default=10, help="progress line every N steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; a user's mistake (a bad argument, a missing file) prints one line, returns 2."""
    args = _parser().parse_args(argv)
    try:
        if not args.data.is_file():
            raise FileNotFoundError(f"--data {args.data} is not a file")
        if args.target == "demo":
            target, encode = load_demo()[0], None
        else:
            target, encode = load_hf(args.target, dtype="float32"), load_tokenizer(args.target).encode
        tokens = read_tokens(args.data, encode)
        vocab = target.config.vocab_size
        if tokens.size and tokens.max() >= vocab:
            raise ValueError(f"--data has token id {tokens.max()} outside the target's vocabulary {vocab}")
        if args.init is not None:
            head = initial_head(args.init, target, draft_vocab_size=args.draft_vocab_size,
                                aux_layers=args.aux_layers)
            size = head.lm_head.out_features
        else:
            size = args.draft_vocab_size or vocab
            d2t, _ = draft_vocabulary(tokens, vocab, size)
            head = new_head(target, draft_to_target=None if size == vocab else np.arange(size) + d2t,
                            aux_layers=args.aux_layers, seed=args.seed)
        batches = random_batches(tokens, steps=args.steps, batch=args.batch, seq_len=args.seq_len, seed=args.seed)
    except (ValueError, OSError) as error:
        print(f"python -m scv_jax.eagle3_train: error: {error}", file=sys.stderr)
        return 2
    print(f"{len(tokens):,} tokens, draft vocabulary {size} of {vocab}, aux layers {list(head.aux_layers)}",
          file=sys.stderr, flush=True)
    start = time.perf_counter()

    def progress(step: int, loss: float, agreement: np.ndarray) -> None:
        if step % args.log_every == 0 or step in (1, args.steps):
            rate = step * args.batch * args.seq_len / (time.perf_counter() - start)
            shown = " ".join(f"{a:.2f}" for a in agreement)
            print(f"step {step}/{args.steps}  loss {loss:.3f}  top-1 agreement per TTT step {shown}  "
                  f"{rate:,.0f} tokens/s", file=sys.stderr, flush=True)

    train_head(head, target, batches, default_optimizer(args.lr, args.steps), ttt_steps=args.ttt_steps,
               on_step=progress)
    out = save_eagle3(head, args.out, dtype=args.dtype)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
