"""Train the demo pair on Python standard-library source: the target, then a draft distilled from it.

    python -m scv_jax.demo.train [--target-steps 500] [--draft-steps 300] [--out DIR]

The draft learns the target's next-byte distribution (KL to the target's probabilities) plus the
target's argmax, so that greedy drafts agree with the target often; half of its batches are text the
target generated itself (greedy and sampled continuations of stdlib snippets), the text drafts meet at
decoding time. ``--draft-only`` reuses the target in ``--out``. Prints progress; writes
``target.npz`` and ``draft.npz`` (float16) to ``scv_jax/demo/weights/``.

``--head-data FILE`` writes the demo EAGLE-3 head's training text instead (``python -m
scv_jax.eagle3_train --data FILE``; docs/eagle3.md): the shipped target's own continuations (half greedy,
half sampled) of stdlib snippets, then as many bytes of the stdlib training split, as UTF-8.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scv_jax.demo.configs import DRAFT_CONFIG, TARGET_CONFIG
from scv_jax.demo.corpus import random_windows, split_corpus, stdlib_bytes
from scv_jax.models.transformer import Transformer
from scv_jax.models.weights import DEMO_WEIGHTS_DIR, load_model, save_model


def adam_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "step": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, lr, *, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, clip=1.0):
    """AdamW with global-norm gradient clipping; returns (params, state)."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (norm + 1e-6)), grads)
    step = state["step"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1 / (jnp.sqrt(v / c2) + eps) + weight_decay * p),
                          params, m, v)
    return params, {"m": m, "v": v, "step": step}


def lr_schedule(progress: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up then cosine decay to 10% of peak; progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.45 * (1 + np.cos(np.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def make_target_step(graphdef):
    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt, batch, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, opt = adam_update(params, grads, opt, lr)
        return params, opt, loss

    return step, jax.jit(loss_fn)


def make_draft_step(draft_graphdef, target_graphdef, target_params, hard_weight: float = 0.5):
    def loss_fn(params, batch):
        target_logits = jax.lax.stop_gradient(nnx.merge(target_graphdef, target_params)(batch))
        target_probs = jax.nn.softmax(target_logits)
        logp = jax.nn.log_softmax(nnx.merge(draft_graphdef, params)(batch))
        soft = -jnp.mean(jnp.sum(target_probs * logp, axis=-1))
        hard = -jnp.mean(jnp.take_along_axis(logp, jnp.argmax(target_logits, -1)[..., None], axis=-1))
        agree = jnp.mean(jnp.argmax(logp, -1) == jnp.argmax(target_logits, -1))
        return (1 - hard_weight) * soft + hard_weight * hard, agree

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt, batch, lr):
        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        params, opt = adam_update(params, grads, opt, lr)
        return params, opt, loss, agree

    return step, jax.jit(loss_fn)


def target_text(target: Transformer, data: np.ndarray, *, num_prompts: int = 256, prompt_len: int = 32,
                new_tokens: int = 160, batch: int = 64, seed: int = 0) -> np.ndarray:
    """uint8[N]: the target's own continuations (half greedy, half sampled at T=1) of stdlib snippets."""
    from scv_jax.decoding.config import DecoderConfig
    from scv_jax.decoding.decoder import SpeculativeDecoder

    rng = np.random.default_rng(seed)
    decoder = SpeculativeDecoder(target, None, config=DecoderConfig(batch_buckets=(batch,), max_seq_len=256,
                                                                    num_blocks=batch * 16))
    chunks, start = [], time.perf_counter()
    for i in range(0, num_prompts, batch):
        prompts = random_windows(data, rng, batch, prompt_len).tolist()
        out = decoder.generate(prompts, new_tokens, temperature=0.0 if (i // batch) % 2 == 0 else 1.0, seed=i)
        chunks += [bytes(p + t) + b"\n\n" for p, t in zip(prompts, out.tokens)]
        print(f"[teacher text] {i + batch}/{num_prompts} sequences  {time.perf_counter() - start:.0f}s",
              flush=True)
    return np.frombuffer(b"".join(chunks), np.uint8)


def head_data(target: Transformer, data: np.ndarray, *, seed: int = 7) -> str:
    """The demo head's training text: 768 of the target's continuations (32-byte prompts, 224 new
    bytes) and as many bytes of ``data`` from a random offset; bytes that are not UTF-8 dropped."""
    generated = target_text(target, data, num_prompts=768, prompt_len=32, new_tokens=224, seed=seed)
    start = np.random.default_rng(0).integers(0, len(data) - len(generated))
    text = np.concatenate([generated, np.frombuffer(b"\n\n", np.uint8), data[start:start + len(generated)]])
    return text.tobytes().decode("utf-8", "ignore")


def mixed_windows(sources: list[np.ndarray], rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """int32[batch, length] windows, an equal share from each source."""
    shares = np.array_split(np.arange(batch), len(sources))
    return np.concatenate([random_windows(src, rng, len(share), length) for src, share in zip(sources, shares)])


def train(model: Transformer, step_fn, eval_fn, data, holdout, *, steps: int, seconds: float, batch: int,
          length: int, peak_lr: float, name: str, seed: int) -> Transformer:
    """Runs ``step_fn`` for ``steps`` steps or ``seconds`` of wall time, whichever ends first (the
    learning-rate schedule follows whichever is further along); prints progress."""
    graphdef, params = nnx.split(model)
    opt = adam_init(params)
    rng = np.random.default_rng(seed)
    eval_batch = jnp.asarray(random_windows(holdout, np.random.default_rng(123), 16, length))
    start, step, last_print, tokens = time.perf_counter(), 0, 0.0, 0
    while (elapsed := time.perf_counter() - start) < seconds and step < steps:
        lr = lr_schedule(max(elapsed / seconds, step / steps), peak_lr)
        sources = data if isinstance(data, list) else [data]
        out = step_fn(params, opt, jnp.asarray(mixed_windows(sources, rng, batch, length)), lr)
        params, opt, metrics = out[0], out[1], out[2:]
        step, tokens = step + 1, tokens + batch * (length - 1)
        if step == 1:
            jax.block_until_ready(params)
            elapsed = time.perf_counter() - start
        if elapsed - last_print > 15 or step == 1:
            last_print = elapsed
            shown = " ".join(f"{float(m):.3f}" for m in metrics)
            print(f"[{name}] step {step:5d}  {elapsed:6.0f}/{seconds:.0f}s  loss/metrics {shown}  "
                  f"{tokens / max(elapsed, 1e-9):,.0f} tok/s", flush=True)
    held_out = eval_fn(params, eval_batch)
    print(f"[{name}] done: {step} steps, {tokens:,} tokens, held-out {np.asarray(held_out)}", flush=True)
    return nnx.merge(graphdef, params)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-steps", type=int, default=500)
    parser.add_argument("--target-seconds", type=float, default=720, help="wall-time cap")
    parser.add_argument("--draft-steps", type=int, default=300)
    parser.add_argument("--draft-seconds", type=float, default=240, help="wall-time cap")
    parser.add_argument("--out", type=pathlib.Path, default=DEMO_WEIGHTS_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-only", action="store_true", help="train only the draft (target from --out)")
    parser.add_argument("--head-data", type=pathlib.Path, help="write the demo head's training text here and exit")
    args = parser.parse_args(argv)
    data, holdout = split_corpus(stdlib_bytes(seed=args.seed))
    print(f"corpus: {len(data):,} training bytes, {len(holdout):,} held out", flush=True)
    if args.head_data:
        args.head_data.write_text(head_data(load_model(args.out / "target.npz"), data), encoding="utf-8")
        print(f"wrote {args.head_data}", flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)

    if args.draft_only:
        target = load_model(args.out / "target.npz")
    else:
        target = Transformer(TARGET_CONFIG, rngs=nnx.Rngs(args.seed))
        step, eval_fn = make_target_step(nnx.graphdef(target))
        target = train(target, step, eval_fn, data, holdout, steps=args.target_steps,
                       seconds=args.target_seconds, batch=16, length=129, peak_lr=2e-3, name="target",
                       seed=args.seed)
        save_model(target, args.out / "target.npz")

    generated = target_text(target, data, seed=args.seed)
    draft = Transformer(DRAFT_CONFIG, rngs=nnx.Rngs(args.seed + 1))
    step, eval_fn = make_draft_step(nnx.graphdef(draft), *nnx.split(target))
    draft = train(draft, step, eval_fn, [data, generated], holdout, steps=args.draft_steps,
                  seconds=args.draft_seconds, batch=16, length=128, peak_lr=3e-3, name="draft",
                  seed=args.seed + 1)
    save_model(draft, args.out / "draft.npz")
    sizes = {p.name: p.stat().st_size for p in args.out.glob("*.npz")}
    print(f"wrote {sizes} to {args.out}", flush=True)


if __name__ == "__main__":
    main()
