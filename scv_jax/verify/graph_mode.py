"""``verify_step`` in graph mode: its padding specs and an ``ExecutableCache`` factory."""

from __future__ import annotations

import functools
from typing import Sequence

from scv_jax.graph.buckets import Buckets, Pad, as_buckets
from scv_jax.graph.executable_cache import ExecutableCache
from scv_jax.verify.step import KVLayout, verify_step

DEFAULT_SPEC_LENS: tuple[int, ...] = (1, 2, 4, 8)


def verify_step_pads(kv_layout: KVLayout = "drafts") -> dict[str, Pad]:
    """How graph mode pads ``verify_step``'s arguments ("rows" is the K/V row dim in query layout)."""
    rows = "tokens" if kv_layout == "drafts" else "rows"
    return {"new_keys": Pad(rows, axis=1), "new_values": Pad(rows, axis=1),
            "slot_mapping": Pad(rows, fill=-1), "draft_token_ids": Pad("tokens"),
            "cu_num_draft_tokens": Pad("batch", fill="edge", extra=1),
            "bonus_token_ids": Pad("batch"), "target_token_ids": Pad("tokens"), "target_logits": Pad("tokens"),
            "target_probs": Pad("tokens"), "draft_probs": Pad("tokens")}


def verify_step_cache(*, batch_buckets: Buckets | Sequence[int] = Buckets.pow2_then_linear(256),
                      spec_lens: Sequence[int] = DEFAULT_SPEC_LENS,
                      token_buckets: Buckets | Sequence[int] | None = None,
                      row_buckets: Buckets | Sequence[int] | None = None,
                      kv_layout: KVLayout = "drafts", cache_dir: str | None = None) -> ExecutableCache:
    """``verify_step`` in graph mode: the KV cache donated, the XLA reference path as fallback.

    Buckets: batch B from ``batch_buckets``, ``max_spec_len`` k from ``spec_lens``; by default the
    draft slots are padded to B * k (one executable per (B, k); T <= B * k always holds) and, in
    query layout, the K/V rows to B * (k + 1). ``token_buckets`` / ``row_buckets`` make them
    independent dims instead (less padding, more executables; ``warmup`` then skips the
    unreachable ones). Call it with ``verify_step``'s arguments; ``request_mask`` is built from
    the real batch size. ``kv_layout="grid"`` is not offered: its rows depend on ``max_spec_len``,
    which graph mode rounds up (use it inside a step function whose k is a bucket, as the decoder does).
    """
    if kv_layout not in ("drafts", "query"):
        raise ValueError(f"verify_step_cache: kv_layout must be 'drafts' or 'query', got {kv_layout!r}")
    batch = batch_buckets if isinstance(batch_buckets, Buckets) else Buckets(tuple(batch_buckets))
    tokens = (as_buckets(token_buckets) if token_buckets is not None
              else (lambda b: b["batch"] * b["max_spec_len"]))
    dims = {"batch": batch, "tokens": tokens}
    if kv_layout == "query":
        dims["rows"] = (as_buckets(row_buckets) if row_buckets is not None
                        else (lambda b: b["batch"] + b["tokens"]))

    def reachable(sizes: dict[str, int]) -> bool:
        """Drops token/row buckets larger than the smallest one holding B * k drafts (B + T rows)."""
        most = {"tokens": sizes["batch"] * sizes["max_spec_len"]}
        most["rows"] = sizes["batch"] + most["tokens"]
        return all(sizes[d] <= (dims[d].bucket(most[d]) or dims[d].largest)
                   for d in ("tokens", "rows") if isinstance(dims.get(d), Buckets))

    return ExecutableCache(verify_step, dims=dims, pads=verify_step_pads(kv_layout),
                           bucketed_statics={"max_spec_len": tuple(sorted(spec_lens))},
                           static_argnames=("kv_layout", "backend"), donate_argnames=("kv_cache",),
                           masks={"request_mask": "batch"}, keep=reachable,
                           fallback=functools.partial(verify_step, backend="xla"),
                           cache_dir=cache_dir, name=f"verify_step[{kv_layout}]")
