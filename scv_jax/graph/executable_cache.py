"""Graph mode: a cache of ahead-of-time compiled executables, one per shape bucket.

The JAX analogue of CUDA-graph capture in serving engines. A step function is compiled once per
bucket (``warmup()``), every call pads its arguments up to a bucket and runs that bucket's
executable, so shapes never wander and nothing recompiles mid-decoding. Bucket keys come from the
static shapes of the arguments and from Python ints (host metadata): computing a key never moves
data between host and device.

    step = ExecutableCache(fn, dims={"batch": [1, 2, 4, 8], "tokens": [4, 8, 16, 32]},
                           pads={"cu": Pad("batch", fill="edge", extra=1), "ids": Pad("tokens")},
                           bucketed_statics={"max_spec_len": [2, 4]}, donate_argnames=("kv",),
                           fallback={"backend": "xla"})
    step.warmup(**example_args)        # compiles every bucket (progress on stderr)
    out = step(**args)                 # padded outputs: rows past the real batch are padding

The cache is built in layers, each a module: ``bucket_plan`` (a call's bucket, host side),
``compiled_buckets`` (an executable per bucket, fallbacks, donation checks), ``scheduling`` (warm-up,
background compiles, priming) and this one (calling: padding, running, retrying on the fallback).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from scv_jax.graph import idle_priority
from scv_jax.graph.bucket_plan import BucketKey, BucketPlan
from scv_jax.graph.buckets import Buckets, Pad, map_arrays, pad_leaf
from scv_jax.graph.scheduling import ScheduledBuckets

logger = logging.getLogger(__name__)


class DonatedRunError(RuntimeError):
    """A bucket's executable failed at run time after consuming its donated arguments."""


class ExecutableCache(ScheduledBuckets):
    """Wraps a step function with bucketed, ahead-of-time compiled executables.

    Args:
      fn: the step function; its arguments are passed by name (positional calls are bound to the
        parameter names). It must be traceable by ``jax.jit``.
      dims: dimension name -> ``Buckets`` (or a list of sizes) it is padded up to, or a function
        deriving its bucket from the other dims' buckets and the bucketed statics (e.g.
        ``lambda b: b["batch"] * b["max_spec_len"]``); derived dims add no buckets of their own.
      pads: argument name -> ``Pad`` (or a list of them) saying which axis carries which dim and the
        fill value. Every array leaf of the argument is padded; ``None`` arguments are skipped.
      bucketed_statics: static argument name -> allowed values; a call's value is rounded up to the
        smallest allowed one (e.g. ``max_spec_len`` from ``[1, 2, 4, 8]``).
      static_argnames: further static arguments (hashable; part of the key as given).
      donate_argnames: arguments donated to the executable (e.g. the KV cache; updated in place).
        Each compile checks ``memory_analysis()`` that the donated bytes are aliased.
      masks: argument name -> dim, for bool[dim] validity masks (True at real entries) that the
        cache builds itself when the caller passes None (or omits them); a given mask is padded
        with False.
      fallback: what serves a bucket whose executable fails to compile or to run: a mapping of
        argument overrides for ``fn`` (e.g. ``{"backend": "xla"}``), or a function taking ``fn``'s
        arguments (a ``functools.partial``'s bound keywords replace the call's); None lets such
        errors propagate. A run-time failure is retried on the fallback only while the call's
        donated arguments are alive, and the bucket moves to the fallback only if that retry
        succeeds (so a caller's own error, e.g. a disallowed transfer, never marks a bucket failed).
        When the failed run consumed donated arguments, the call raises ``DonatedRunError`` and
        later calls of the bucket use the fallback.
      cache_dir: opt-in JAX persistent compilation cache directory (process-wide; see
        ``enable_persistent_cache``) so that a restart loads executables instead of compiling.
      keep: a default ``warmup`` filter of buckets that can never occur (see ``all_keys``).
      stand_ins: static argument -> {a call's value: the value whose executable may run that call in
        its stead} (e.g. ``{"greedy": {True: False}}``: a sampled step runs an all-greedy batch too):
        while buckets compile in the background, a call may run on such an executable (``can_run``,
        ``ready_plan``), which must compute what the call's own would (its outputs may hold more).
      name: a label for progress lines and logs.
      split_dims: grid dims along which the caller splits a call instead of padding it while buckets
        compile in the background (``split_size``); ``compiler.largest_first`` compiles such a dim's
        smallest bucket first.
    """

    def __init__(self, fn: Callable, *,
                 dims: Mapping[str, Buckets | Sequence[int] | Callable[[dict[str, Any]], int]],
                 pads: Mapping[str, Pad | Sequence[Pad]],
                 bucketed_statics: Mapping[str, Buckets | Sequence[int]] | None = None,
                 static_argnames: Sequence[str] = (), donate_argnames: Sequence[str] = (),
                 masks: Mapping[str, str] | None = None,
                 fallback: Callable | Mapping[str, Any] | None = None,
                 cache_dir: str | None = None, keep: Callable[[dict[str, int]], bool] | None = None,
                 stand_ins: Mapping[str, Mapping[Any, Any]] | None = None, name: str | None = None,
                 split_dims: Sequence[str] = ()):
        super().__init__(fn, dims=dims, pads=pads, bucketed_statics=bucketed_statics,
                         static_argnames=static_argnames, donate_argnames=donate_argnames, masks=masks,
                         fallback=fallback, cache_dir=cache_dir, keep=keep, stand_ins=stand_ins, name=name,
                         split_dims=split_dims)
        self._device_masks: dict[tuple[int, int], jax.Array] = {}
        self._last_call_compiled = self._last_call_first_run = False
        self._last_plan: BucketPlan | None = None
        self._oversize_seen: set[tuple] = set()

    @property
    def last_call_compiled(self) -> bool:
        """Whether the most recent call compiled an executable (a bucket miss)."""
        return self._last_call_compiled

    @property
    def last_call_shape(self) -> str:
        """The most recent call's bucket, e.g. ``"decode_step(batch=4, blocks=16, k=2, greedy=True)"``
        (unpadded sizes for an oversize call); "" before any call."""
        plan = self._last_plan
        if plan is None:
            return ""
        if plan.key is None:
            sizes = ", ".join(f"{d}={s}" for d, s in plan.real.items())
            return f"{self.name}(oversize {sizes})"
        return f"{self.name}({self.describe(plan.key)})"

    @property
    def last_call_fallback(self) -> str:
        """Why the most recent call ran on the fallback (its bucket's executable failed to compile or to
        run: ``failed``), or "" when it ran its own executable."""
        plan = self._last_plan
        entry = self._entries.get(plan.key) if plan is not None and plan.key is not None else None
        return self.failed.get(plan.key, "") if entry is not None and entry.is_fallback else ""

    @property
    def last_call_first_run(self) -> bool:
        """Whether the most recent call was its executable's first (compiled by the call or ahead of
        time by ``warmup``): a first run pays one-off costs (~15 ms for a demo step on XLA:CPU), so
        its time is not the shape's."""
        return self._last_call_first_run

    # ------------------------------------------------------------------------------------ padding
    def _validity_mask(self, real: int, padded: int) -> jax.Array:
        """bool[padded], True below ``real``: built once per pair and kept on the device, so a call
        whose own arguments are all on the device transfers nothing (also under a transfer guard)."""
        mask = self._device_masks.get((real, padded))
        if mask is None:
            mask = self._device_masks[(real, padded)] = jax.device_put(np.arange(padded) < real)
        return mask

    def _padded_args(self, bound: dict[str, Any], plan: BucketPlan) -> dict[str, Any]:
        """A call's bound arguments padded to ``plan``'s bucket sizes, missing validity masks built and
        statics set to the plan's (counting device-side pads in ``stats.device_pads``)."""
        out = dict(bound)
        for arg, dim in self.masks.items():
            if out.get(arg) is None:
                out[arg] = self._validity_mask(plan.real[dim], plan.padded[dim])
        device_pads = 0
        for arg, arg_pads in self.pads.items():
            value = out.get(arg)
            if value is None:
                continue
            for pad in arg_pads:
                def one(leaf, pad=pad):
                    nonlocal device_pads
                    padded, on_device = pad_leaf(leaf, pad, plan.padded[pad.dim])
                    device_pads += on_device
                    return padded
                value = map_arrays(one, value)
            out[arg] = value
        out.update(plan.statics)
        self.stats.device_pads += device_pads
        return out

    # ------------------------------------------------------------------------------------ calling
    def __call__(self, *args, **kwargs):
        """Runs the step: pads to the bucket and calls its executable (compiling it on a miss).

        Returns ``fn``'s outputs at the padded sizes. Sizes beyond the largest bucket run unpadded
        through plain ``jax.jit`` (counted in ``stats.oversize``; it compiles per exact shape, and each
        new one is logged once).
        """
        bound = self._bind(args, kwargs)
        plan = self.ready_plan(self._plan(bound))
        if plan.key is None:
            return self._run(plan, self._dynamic_values(bound))
        return self._run(plan, self._dynamic_values(self._padded_args(bound, plan)))

    def call_planned(self, plan: BucketPlan, dynamic: Sequence[Any]) -> Any:
        """The fast path of ``__call__`` for callers that build their arguments at bucket size.

        ``plan`` comes from ``plan`` or ``plan_sizes``; ``dynamic`` holds every dynamic argument in
        ``dynamic_argnames`` order, already padded to ``plan.padded`` (unpadded when ``plan.key`` is
        None: oversize), None where not given; a None validity mask (``masks``) is built from
        ``plan.real``. No planning or padding happens; compiling, counting and fallbacks are those of
        ``__call__``.
        """
        dynamic = list(dynamic)
        if len(dynamic) != len(self._dynamic):
            raise TypeError(f"{self.name}: call_planned takes {len(self._dynamic)} dynamic arguments "
                            f"{self._dynamic}, got {len(dynamic)}")
        if plan.key is not None:
            for i, dim in self._mask_positions:
                if dynamic[i] is None:
                    dynamic[i] = self._validity_mask(plan.real[dim], plan.padded[dim])
        return self._run(plan, dynamic)

    def _run(self, plan: BucketPlan, dynamic: list[Any]) -> Any:
        """Calls ``plan``'s executable on padded dynamic arguments (plain jit when oversize)."""
        self._last_call_compiled = self._last_call_first_run = False
        self._last_plan = plan
        if plan.key is None:
            self.stats.oversize += 1
            shape = (tuple(plan.real.items()), tuple(plan.statics.items()))
            if shape not in self._oversize_seen:
                self._oversize_seen.add(shape)
                logger.warning("%s: a call beyond the largest bucket runs through plain jit at its own size "
                               "(compiled per exact shape): %s", self.name, self.last_call_shape)
            return self._jitted(*dynamic, **plan.statics)
        for dim, size in plan.real.items():
            self.stats.real_totals[dim] = self.stats.real_totals.get(dim, 0) + size
            self.stats.padded_totals[dim] = self.stats.padded_totals.get(dim, 0) + plan.padded[dim]
        entry = self._entries.get(plan.key)
        if entry is None:
            self.stats.misses += 1
            entry = self._await_scheduled(plan.key)
        if entry is None:
            logger.warning("%s: compiling bucket (%s) on the calling thread (%s): %s", self.name,
                           self.describe(plan.key), threading.current_thread().name, self._why_new(plan.key))
            with idle_priority.at_normal_priority():      # a background compiler's idle helpers: back up
                entry, _ = self._compile_one(plan.key, self._named(plan, dynamic))
            with self._lock:
                self._entries[plan.key] = entry
            self._last_call_compiled = True
        else:
            self.stats.hits += 1
        self._last_call_first_run, entry.ran = not entry.ran, True
        if entry.is_fallback:
            self.stats.fallbacks += 1
            return entry.executable(*dynamic)
        try:
            return entry.executable(*dynamic)
        except jax.errors.JaxRuntimeError as error:
            if self._fallback_jitted is None:
                raise
            return self._after_run_failure(plan.key, self._named(plan, dynamic), dynamic, error)

    def _why_new(self, key: BucketKey) -> str:
        """Why ``key`` had no executable: the dims and statics whose values no compiled bucket has, or a
        new combination of known ones; and whether a warm-up ran."""
        warm = "after a warm-up: a shape the warm-up did not cover" if self._warmed_up else "warmup() was never called"
        with self._lock:
            compiled = list(self._entries)
        if not compiled:
            return f"the first executable of {self.name}, {warm}"
        names, values = (*self.dims, *self.static_argnames), (*key[0], *key[1])
        new = [f"{n}={v}" for i, (n, v) in enumerate(zip(names, values))
               if all((*k[0], *k[1])[i] != v for k in compiled)]
        if all(k[2] != key[2] for k in compiled):
            new.append(f"arguments given {sorted(key[2])}")
        return f"new {', '.join(new)}, {warm}" if new else f"a new combination of compiled sizes, {warm}"

    def _named(self, plan: BucketPlan, dynamic: list[Any]) -> dict[str, Any]:
        """The arguments of a call by name: dynamic values and the plan's statics."""
        return {**dict(zip(self._dynamic, dynamic)), **plan.statics}

    def _after_run_failure(self, key: BucketKey, padded: dict[str, Any], dynamic: list[Any], error: Exception):
        """Retries a failed run on the fallback while the donated inputs are alive (see ``fallback``)."""
        consumed = [a for a in self.donate_argnames
                    if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(padded.get(a)))]
        if consumed:
            self._mark_failed(key, self._reason("run failed", error))
            del self._entries[key]   # the next call of this bucket compiles the fallback
            raise DonatedRunError(
                f"{self.name}: bucket ({self.describe(key)}) failed at run time after its donated arguments "
                f"{consumed} were consumed, so it cannot be retried; later calls of this bucket use the "
                f"fallback. Cause: {error}") from error
        fallback, _ = self._compile_one(key, padded, fallback_only=True)
        try:
            result = fallback.executable(*dynamic)
        except Exception:
            raise error from None  # the fallback fails too: the inputs are at fault, not the executable
        self._mark_failed(key, self._reason("run failed", error))
        self._entries[key] = fallback
        self.stats.fallbacks += 1
        return result
