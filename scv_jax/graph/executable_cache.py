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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import re
import sys
import threading
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from scv_jax.graph import idle_priority
from scv_jax.graph.buckets import (Buckets, Pad, array_leaves, as_buckets, is_array_leaf, map_arrays,
                             pad_leaf, real_size)
from scv_jax.graph.compiler import CompileJob, Compiler

logger = logging.getLogger(__name__)


class DonatedRunError(RuntimeError):
    """A bucket's executable failed at run time after consuming its donated arguments."""

# (dim buckets in ``dims`` order, static values in ``static_argnames`` order, names of the arguments
# given and not None: optional arguments change the executable's signature)
BucketKey = tuple


class BucketPlan(NamedTuple):
    """Where one call lands. ``key`` is None when a size exceeds the largest bucket."""

    key: BucketKey | None
    real: dict[str, int]        # dim -> unpadded size
    padded: dict[str, int]      # dim -> bucket size
    statics: dict[str, Any]     # static argument -> (bucketed) value


@dataclasses.dataclass
class GraphModeStats:
    """Counters of an ``ExecutableCache`` (host-side, cheap to read).

    ``padding_ratio(dim)`` is padded / real size summed over all bucketed calls (1.0 = no waste).
    ``unaliased_donations``: executables whose outputs do not alias the donated arguments;
    ``copied_donations``: executables that alias them but copy arrays of their shapes inside (found
    in the optimized HLO; the in-place update is then lost).
    ``borrowed``: calls that ran padded to a larger compiled bucket while their own compiled in the
    background (``ready_plan``); ``waits``: calls that waited for their own bucket's background compile.
    """

    hits: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    fallbacks: int = 0
    failed_buckets: int = 0
    oversize: int = 0
    device_pads: int = 0
    unaliased_donations: int = 0
    copied_donations: int = 0
    borrowed: int = 0
    waits: int = 0
    real_totals: dict[str, int] = dataclasses.field(default_factory=dict)
    padded_totals: dict[str, int] = dataclasses.field(default_factory=dict)

    def padding_ratio(self, dim: str) -> float:
        real = self.real_totals.get(dim, 0)
        return self.padded_totals.get(dim, 0) / real if real else float("nan")


class WarmupReport(NamedTuple):
    buckets: int            # buckets considered
    compiled: int           # executables compiled now (bucket executables and fallbacks)
    failed: int             # buckets whose executable failed to compile (served by the fallback)
    wall_seconds: float
    compile_seconds: float  # summed over buckets (exceeds wall time with parallel threads)


@dataclasses.dataclass
class _Entry:
    executable: Any          # jax.stages.Compiled, taking the dynamic arguments positionally
    is_fallback: bool
    ran: bool = False        # called at least once


def _positional(fn: Callable, dynamic: tuple[str, ...], name: str, fixed: frozenset[str] = frozenset()) -> Callable:
    """``fn`` taking its dynamic arguments positionally (in ``dynamic``'s order) and its static ones by
    keyword, called ``name`` (jit names its compilations ``jit(name)``); arguments in ``fixed`` (bound
    by a fallback's ``functools.partial``) are dropped."""
    def call(*values, **statics):
        named = {**dict(zip(dynamic, values)), **statics}
        return fn(**{a: v for a, v in named.items() if a not in fixed})
    call.__name__ = name
    return call


def _error_lines(error: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``error``'s message, plus its last line when that differs (a callback's or
    a compiler's message often ends with the exception that caused it), at most ``limit`` characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = "; ".join(dict.fromkeys(lines[:1] + lines[-1:])) if lines else "(no message)"
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _failing_op(error: BaseException) -> str:
    """The op whose lowering raised ``error``, as far as JAX's lowering frames show it: the innermost
    equation's primitive (with its ``name`` when it has one, e.g. a Pallas call's) and the innermost
    source location among the equations being lowered (the kernel or op function that emitted it), e.g.
    "mpmd_map from commit_kv_kernel (pallas_kernels/commit_kv.py:204)"; for an error raised while
    tracing, the innermost function outside JAX that raised it. "" when neither is found (a run-time
    failure, or JAX's internals changed): this reads frame locals and never raises."""
    try:
        import traceback

        from jax._src import source_info_util
        primitive, where = "", ""
        for frame, _ in traceback.walk_tb(error.__traceback__):
            eqn = frame.f_locals.get("eqn")
            if eqn is None or not hasattr(eqn, "primitive") or not hasattr(eqn, "source_info"):
                continue
            name = eqn.params.get("name") if isinstance(getattr(eqn, "params", None), dict) else None
            primitive = eqn.primitive.name + (f" {name!r}" if isinstance(name, str) and name not in ("", "anonymous")
                                              else "")
            frame_info = source_info_util.user_frame(eqn.source_info.traceback)
            if frame_info is not None:
                path = "/".join(frame_info.file_name.replace("\\", "/").split("/")[-2:])
                where = f"{frame_info.function_name} ({path}:{frame_info.start_line})"
        if primitive:
            return primitive + (f" from {where}" if where else "")
        # Raised while tracing (e.g. a kernel refusing its inputs): the innermost frame outside JAX.
        for summary in reversed(traceback.extract_tb(error.__traceback__)):
            path = summary.filename.replace("\\", "/")
            if "/jax/" not in path and "/jaxlib/" not in path and not path.endswith("graph/executable_cache.py"):
                return f"{summary.name} ({'/'.join(path.split('/')[-2:])}:{summary.lineno})"
        return ""
    except Exception:  # noqa: BLE001 - best effort: the reason is still recorded without it
        return ""


def enable_persistent_cache(cache_dir: str, *, min_compile_time_secs: float = 0.0,
                            min_entry_size_bytes: int = 0) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir`` (process-wide JAX config)."""
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry_size_bytes)
    if jax.config.jax_compilation_cache_dir != cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used


_COPY_CHECK_BYTES = 1 << 12   # donated arrays smaller than this are not checked for copies
_HLO_COPY = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\](?:\{[^}]*\})? copy\(")
_NONE = object()               # no stand-in
PRIME_MAX_BYTES = 1 << 30      # a primed executable's zero arguments (caches included) are at most this


def _copied_arrays(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(HLO element type, shape) of the arrays that ``copy`` instructions of an optimized HLO module produce."""
    return [(kind, tuple(int(d) for d in dims.split(",") if d)) for kind, dims in _HLO_COPY.findall(hlo_text)]


def _hlo_type(dtype: Any) -> str:
    """The HLO element type of a numpy / JAX dtype: f32, s32, u32, bf16, f8e4m3fn, pred, ..."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "pred"
    if dtype.name.startswith("float8_"):
        return "f8" + dtype.name[len("float8_"):]
    if dtype.name == "bfloat16":
        return "bf16"
    return {"f": "f", "i": "s", "u": "u", "c": "c"}.get(dtype.kind, dtype.name) + str(8 * dtype.itemsize)


def _local_shape(leaf: Any) -> tuple[int, ...]:
    """The shape of one device's shard of an array (all of it unless sharded): what a compiled SPMD
    program, its memory analysis and its HLO see."""
    sharding = getattr(leaf, "sharding", None)
    return tuple(sharding.shard_shape(tuple(leaf.shape)) if sharding is not None else leaf.shape)


def _nbytes(leaf: Any) -> int:
    """Bytes of one device's shard of an array leaf (0 for non-arrays)."""
    return int(np.prod(_local_shape(leaf))) * np.dtype(leaf.dtype).itemsize if is_array_leaf(leaf) else 0


class ExecutableCache:
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
        self.name = name or getattr(fn, "__name__", "step")
        parameters = inspect.signature(fn).parameters
        self._params = tuple(parameters)
        self._defaults = {a: p.default for a, p in parameters.items()
                          if p.default is not inspect.Parameter.empty}
        self.dims = {dim: b if callable(b) else as_buckets(b) for dim, b in dims.items()}
        self._grid_dims = {dim: b for dim, b in self.dims.items() if isinstance(b, Buckets)}
        self.split_dims = tuple(split_dims)
        for dim in self.split_dims:
            if dim not in self._grid_dims:
                raise ValueError(f"ExecutableCache: split_dims names {dim!r}, not one of the bucketed dims "
                                 f"{tuple(self._grid_dims)}")
        self.keep = keep
        self.pads = {arg: (p,) if isinstance(p, Pad) else tuple(p) for arg, p in pads.items()}
        self.masks = dict(masks or {})
        for arg, dim in self.masks.items():
            self.pads.setdefault(arg, (Pad(dim, fill=False),))
        self.bucketed_statics = {a: as_buckets(v) for a, v in (bucketed_statics or {}).items()}
        self.static_argnames = tuple(self.bucketed_statics) + tuple(
            a for a in static_argnames if a not in self.bucketed_statics)
        self.donate_argnames = tuple(donate_argnames)
        self.stand_ins = {a: dict(v) for a, v in (stand_ins or {}).items()}
        for arg in (*self.pads, *self.static_argnames, *self.donate_argnames):
            if arg not in self._params:
                raise ValueError(f"ExecutableCache: {arg!r} is not a parameter of {self.name} "
                                 f"(parameters: {self._params})")
        for arg in self.stand_ins:
            if arg not in self.static_argnames:
                raise ValueError(f"ExecutableCache: stand_ins names {arg!r}, not one of the static arguments "
                                 f"{self.static_argnames}")
        for arg, arg_pads in self.pads.items():
            for p in arg_pads:
                if p.dim not in self.dims:
                    raise ValueError(f"ExecutableCache: pads[{arg!r}] uses dim {p.dim!r}, "
                                     f"not one of dims {tuple(self.dims)}")
        self._carriers = {dim: [(a, p) for a, ps in self.pads.items() for p in ps if p.dim == dim]
                          for dim in self.dims}
        # Dynamic arguments go to jit positionally in signature order: jit flattens keyword arguments in
        # sorted order, and pairs donated inputs with same-shaped outputs in flattening order, so
        # keywords could pair e.g. a donated draft cache with the target cache's output (a copy).
        self._dynamic = tuple(a for a in self._params if a not in self.static_argnames)
        self._mask_positions = tuple((self._dynamic.index(a), dim) for a, dim in self.masks.items())
        jit_options = dict(static_argnames=self.static_argnames,
                           donate_argnums=tuple(i for i, a in enumerate(self._dynamic) if a in self.donate_argnames))
        self._jitted = jax.jit(_positional(fn, self._dynamic, self.name), **jit_options)
        if isinstance(fallback, Mapping):
            fallback = functools.partial(fn, **fallback)
        self._fallback_jitted = None
        if fallback is not None:
            fixed = frozenset(getattr(fallback, "keywords", None) or ())
            self._fallback_jitted = jax.jit(_positional(fallback, self._dynamic, self.name, fixed), **jit_options)
        if cache_dir is not None:
            enable_persistent_cache(cache_dir)
        self.stats = GraphModeStats()
        self.failed: dict[BucketKey, str] = {}   # bucket -> why its executable is not used
        self._entries: dict[BucketKey, _Entry] = {}
        self._device_masks: dict[tuple[int, int], jax.Array] = {}
        self._last_call_compiled = self._last_call_first_run = False
        self._last_plan: BucketPlan | None = None
        self._warmed_up = False               # a warm-up ran (a later compile is a shape it missed)
        # buckets a ``Compiler`` will compile: a call needing one hurries it and waits, never compiles it
        self._scheduled: dict[BucketKey, tuple[concurrent.futures.Future, Compiler]] = {}
        self._oversize_seen: set[tuple] = set()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- host-side keys
    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if len(args) > len(self._params):
            raise TypeError(f"{self.name}: takes {len(self._params)} arguments, got {len(args)}")
        bound = dict(zip(self._params, args))
        bound.update(kwargs)
        return bound

    def _dynamic_values(self, args: Mapping[str, Any]) -> list[Any]:
        """The dynamic arguments in signature order (defaults where not given)."""
        values = []
        for arg in self._dynamic:
            if arg not in args and arg not in self._defaults:
                raise TypeError(f"{self.name}: missing argument {arg!r}")
            values.append(args[arg] if arg in args else self._defaults[arg])
        return values

    def _plan(self, bound: Mapping[str, Any]) -> BucketPlan:
        real = {}
        for dim in self.dims:
            size, source = None, None
            for arg, pad in self._carriers[dim]:
                value = bound.get(arg)
                if value is None:
                    continue
                for leaf in array_leaves(value):
                    n = real_size(leaf, pad, arg)
                    if size is None:
                        size, source = n, arg
                    elif n != size:
                        raise ValueError(f"{self.name}: {arg!r} says {dim}={n} but {source!r} says "
                                         f"{dim}={size}")
            if size is None:
                raise ValueError(f"{self.name}: no argument carries dim {dim!r} "
                                 f"(carriers: {[a for a, _ in self._carriers[dim]]})")
            real[dim] = size
        return self._plan_sizes(real, bound, self._present(bound))

    def _plan_sizes(self, real: dict[str, int], bound: Mapping[str, Any], present: frozenset[str]) -> BucketPlan:
        """The plan of a call with unpadded dim sizes ``real``, static values in ``bound``."""
        padded = {dim: self._grid_dims[dim].bucket(real[dim]) for dim in self._grid_dims}
        statics = {}
        for arg in self.static_argnames:
            if arg not in bound and arg not in self._defaults:
                raise TypeError(f"{self.name}: missing static argument {arg!r}")
            value = bound.get(arg, self._defaults.get(arg))
            statics[arg] = (self.bucketed_statics[arg].bucket(value)
                            if arg in self.bucketed_statics else value)
        grid = {**padded, **{a: statics[a] for a in self.bucketed_statics}}
        if any(v is None for v in grid.values()):
            return BucketPlan(None, real, padded, statics)
        padded = self._derive(grid)
        if any(real[dim] > padded[dim] for dim in real):
            return BucketPlan(None, real, padded, statics)
        key = (tuple(padded.values()), tuple(statics.values()), present)
        return BucketPlan(key, real, padded, statics)

    def _present(self, bound: Mapping[str, Any]) -> frozenset[str]:
        return frozenset(a for a, v in bound.items() if v is not None and a not in self.static_argnames)

    def _derive(self, grid: dict[str, int]) -> dict[str, int]:
        """All dims' bucket sizes (in ``dims`` order) from the grid dims and bucketed statics."""
        sizes = dict(grid)
        for dim, buckets in self.dims.items():
            if dim not in self._grid_dims:
                sizes[dim] = int(buckets(sizes))
        return {dim: sizes[dim] for dim in self.dims}

    def plan(self, *args, **kwargs) -> BucketPlan:
        """The bucket a call would use, from static shapes and Python values only (no transfers)."""
        return self._plan(self._bind(args, kwargs))

    @property
    def dynamic_argnames(self) -> tuple[str, ...]:
        """The dynamic (non-static) arguments in signature order: the order ``call_planned`` takes."""
        return self._dynamic

    def plan_sizes(self, real: Mapping[str, int], given: Sequence[str], **statics) -> BucketPlan:
        """The plan of a call whose unpadded dim sizes are ``real`` (every dim), whose dynamic arguments
        ``given`` are not None, with these static arguments: what ``plan`` returns for such a call,
        without arguments. For callers that build their arguments at bucket size (``call_planned``)."""
        missing = [dim for dim in self.dims if dim not in real]
        if missing:
            raise ValueError(f"{self.name}: plan_sizes needs a size for every dim, missing {missing}")
        unknown = [a for a in given if a not in self._dynamic]
        if unknown:
            raise ValueError(f"{self.name}: {unknown} are not dynamic arguments (those are {self._dynamic})")
        return self._plan_sizes(dict(real), statics, frozenset(given))

    def bucket(self, dim: str, size: int) -> int | None:
        """The bucket size that ``size`` of grid dim ``dim`` is padded to (None: beyond the largest)."""
        if dim not in self._grid_dims:
            raise ValueError(f"{self.name}: {dim!r} is not a bucketed dim (bucketed: {tuple(self._grid_dims)})")
        return self._grid_dims[dim].bucket(size)

    def split_size(self, dim: str, size: int) -> int:
        """How much of ``size`` along split dim ``dim`` one call should take: ``size`` when no bucket is
        scheduled in the background or one of ``size``'s own bucket along ``dim`` is compiled; else the
        largest compiled bucket size below ``size`` (the caller splits its call over calls of that size
        instead of padding it to a larger bucket), else ``size``."""
        if dim not in self.split_dims:
            raise ValueError(f"{self.name}: {dim!r} is not a split dim (split_dims: {self.split_dims})")
        with self._lock:
            if not self._scheduled:
                return size
            index = tuple(self.dims).index(dim)
            compiled = {key[0][index] for key in self._entries}
        if self.bucket(dim, size) in compiled:
            return size
        return max((s for s in compiled if s < size), default=size)

    @property
    def last_call_compiled(self) -> bool:
        """Whether the most recent call compiled an executable (a bucket miss)."""
        return self._last_call_compiled

    @property
    def jit_name(self) -> str:
        """The name XLA compilations of this cache's executables carry (``CompileCounter.names``)."""
        return f"jit({self.name})"

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

    def describe(self, key: BucketKey) -> str:
        dims, statics, _ = key
        parts = [f"{d}={s}" for d, s in zip(self.dims, dims)]
        parts += [f"{a}={v}" for a, v in zip(self.static_argnames, statics)]
        return ", ".join(parts)

    # ------------------------------------------------------------------------------------ padding
    def _validity_mask(self, real: int, padded: int) -> jax.Array:
        """bool[padded], True below ``real``: built once per pair and kept on the device, so a call
        whose own arguments are all on the device transfers nothing (also under a transfer guard)."""
        mask = self._device_masks.get((real, padded))
        if mask is None:
            mask = self._device_masks[(real, padded)] = jax.device_put(np.arange(padded) < real)
        return mask

    def _padded_args(self, bound: dict[str, Any], plan: BucketPlan) -> dict[str, Any]:
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

    def _abstract_args(self, bound: dict[str, Any], key: BucketKey) -> dict[str, Any]:
        """Example arguments turned into the bucket's abstract signature (for warm-up)."""
        padded = dict(zip(self.dims, key[0]))
        out = dict(bound)
        for arg, arg_pads in self.pads.items():
            if out.get(arg) is None:
                continue
            def abstract(leaf, arg_pads=arg_pads):
                shape = list(np.shape(leaf))
                for pad in arg_pads:
                    shape[pad.axis] = padded[pad.dim] + pad.extra
                dtype = jax.dtypes.canonicalize_dtype(leaf.dtype if is_array_leaf(leaf)
                                                      else np.asarray(leaf).dtype)
                return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                            sharding=getattr(leaf, "sharding", None))
            out[arg] = map_arrays(abstract, out[arg])
        for arg, dim in self.masks.items():
            if out.get(arg) is None:
                out[arg] = jax.ShapeDtypeStruct((padded[dim],), np.bool_)
        out.update(zip(self.static_argnames, key[1]))
        return out

    # ---------------------------------------------------------------------------------- compiling
    def _compile_one(self, key: BucketKey, trace_args: dict[str, Any], *,
                     fallback_only: bool = False) -> tuple[_Entry, int]:
        """Compiles ``key``'s executable (the fallback's if it fails); returns it and #compiles."""
        compiles = 0
        for is_fallback, jitted in ((False, self._jitted), (True, self._fallback_jitted)):
            if jitted is None:
                break
            if not is_fallback and (key in self.failed or fallback_only):
                continue
            start = time.perf_counter()
            statics = {a: trace_args[a] for a in self.static_argnames if a in trace_args}
            try:
                compiled = jitted.trace(*self._dynamic_values(trace_args), **statics).lower().compile()
            except Exception as error:  # noqa: BLE001 - any capture failure falls back
                if is_fallback or self._fallback_jitted is None:
                    raise
                self._mark_failed(key, self._reason("compile failed", error))
                continue
            finally:
                with self._lock:
                    self.stats.compile_seconds += time.perf_counter() - start
            compiles += 1
            with self._lock:
                self.stats.compiles += 1
            self._check_donation(key, compiled, trace_args)
            return _Entry(compiled, is_fallback), compiles
        raise RuntimeError(f"{self.name}: bucket ({self.describe(key)}) has no executable: "
                           f"{self.failed.get(key)}")

    def _reason(self, what: str, error: BaseException) -> str:
        """Why a bucket moves to the fallback: this executable's name, what failed, the op whose
        lowering raised (when JAX's frames show it) and the error's first (and last) line, e.g.
        "decode_step: compile failed in mpmd_map from commit_kv_kernel (pallas_kernels/commit_kv.py:204):
        ValueError: Only interpret mode is supported on CPU backend"."""
        op = _failing_op(error)
        return f"{self.name}: {what}{f' in {op}' if op else ''}: {_error_lines(error)}"

    def _mark_failed(self, key: BucketKey, reason: str) -> None:
        with self._lock:
            if key in self.failed:
                return
            self.failed[key] = reason
            self.stats.failed_buckets += 1
        logger.warning("%s; bucket (%s) falls back to the reference path", reason, self.describe(key))

    def _check_donation(self, key: BucketKey, compiled: Any, trace_args: dict[str, Any]) -> None:
        donated = sum(_nbytes(leaf) for arg in self.donate_argnames
                      for leaf in jax.tree.leaves(trace_args.get(arg)))
        if not donated:
            return
        aliased = getattr(compiled.memory_analysis(), "alias_size_in_bytes", None)
        if aliased is not None and aliased < donated:
            with self._lock:
                self.stats.unaliased_donations += 1
            logger.warning("%s: bucket (%s) aliases %d of %d donated bytes: the donated arguments %s "
                           "are copied, not updated in place", self.name, self.describe(key),
                           aliased, donated, self.donate_argnames)
            return
        # element type and shape: a step's [B, V] random bits (u32) are not its [S, V] control state (f32)
        donated_arrays = {(_hlo_type(leaf.dtype), _local_shape(leaf)) for arg in self.donate_argnames
                          for leaf in jax.tree.leaves(trace_args.get(arg)) if _nbytes(leaf) >= _COPY_CHECK_BYTES}
        copied = [shape for kind, shape in _copied_arrays(compiled.as_text()) if (kind, shape) in donated_arrays]
        if copied:
            with self._lock:
                self.stats.copied_donations += 1
            logger.warning("%s: bucket (%s) copies arrays of the donated arguments' shapes %s inside the "
                           "executable: the donated arguments %s are not updated in place",
                           self.name, self.describe(key), sorted(set(copied)), self.donate_argnames)

    @property
    def compiled_keys(self) -> list[BucketKey]:
        """The keys of the buckets compiled so far (``executable(key)`` of each is not None)."""
        return list(self._entries)

    def executable(self, key: BucketKey) -> Any | None:
        """The compiled executable serving ``key`` (``jax.stages.Compiled``), or None."""
        entry = self._entries.get(key)
        return entry.executable if entry else None

    def all_keys(self, keep: Callable[[dict[str, int]], bool] | None = None) -> list[tuple]:
        """Every bucket as (dim sizes, bucketed static values): the product of the grid dims' and
        bucketed statics' values, with derived dims computed, filtered by
        ``keep({dim or bucketed static: size})`` (default ``self.keep``)."""
        keep = keep or self.keep
        names = (*self._grid_dims, *self.bucketed_statics)
        grids = [b.sizes for b in (*self._grid_dims.values(), *self.bucketed_statics.values())]
        keys = []
        for combo in itertools.product(*grids):
            grid = dict(zip(names, combo))
            padded = self._derive(grid)
            if keep is None or keep({**padded, **grid}):
                keys.append((tuple(padded.values()), combo[len(self._grid_dims):]))
        return keys

    def _warmup_keys(self, bound: dict[str, Any], keep: Callable[[dict[str, int]], bool] | None) -> list[BucketKey]:
        """The buckets a warm-up from example arguments ``bound`` considers."""
        example_plan = self._plan(bound)
        other_statics = tuple(example_plan.statics[a] for a in self.static_argnames
                              if a not in self.bucketed_statics)
        present = self._present(bound)
        return [(dims, statics + other_statics, present) for dims, statics in self.all_keys(keep)]

    def pending(self, *example_args, keep: Callable[[dict[str, int]], bool] | None = None,
                **example_kwargs) -> list[BucketKey]:
        """The buckets ``warmup`` with these arguments would compile now (those not compiled yet), without
        compiling anything: what a warm-up costs, before paying it."""
        keys = self._warmup_keys(self._bind(example_args, example_kwargs), keep)
        return [k for k in keys if k not in self._entries]

    def warmup(self, *example_args, keep: Callable[[dict[str, int]], bool] | None = None,
               max_workers: int = 1, progress: bool = True, **example_kwargs) -> WarmupReport:
        """Compiles every bucket ahead of time from one example call's arguments.

        The example's padded axes may have any size (they are replaced per bucket); its other shapes,
        dtypes, shardings and its unbucketed static values are what every bucket is compiled for.
        ``keep`` prunes buckets that can never occur (default: the constructor's);
        ``max_workers > 1`` compiles in threads (XLA releases the GIL while compiling).
        """
        jobs = self.jobs(*example_args, keep=keep, **example_kwargs)
        start = time.perf_counter()
        seconds_before = self.stats.compile_seconds

        def on_compiled(job: CompileJob, compiles: int, seconds: float, done: int, total: int) -> None:
            if progress:
                sys.stderr.write(f"[{self.name}] warm-up {done}/{total} ({self.describe(job.key)})"   # one write
                                 f"{' [fallback]' if job.key in self.failed else ''} compile {seconds:.2f}s, "
                                 f"{time.perf_counter() - start:.1f}s\n")
                sys.stderr.flush()

        compiled = Compiler(max_workers, on_compiled=on_compiled).run(jobs)
        self._warmed_up = True         # also when every bucket was compiled already
        keys = self._warmup_keys(self._bind(example_args, example_kwargs), keep)
        report = WarmupReport(len(keys), compiled, sum(k in self.failed for k in keys),
                              time.perf_counter() - start, self.stats.compile_seconds - seconds_before)
        if progress:
            print(f"[{self.name}] warm-up done: {report.compiled} executables for {report.buckets} "
                  f"buckets in {report.wall_seconds:.2f}s ({report.failed} on the fallback)",
                  file=sys.stderr, flush=True)
        return report

    def jobs(self, *example_args, keep: Callable[[dict[str, int]], bool] | None = None,
             **example_kwargs) -> list[CompileJob]:
        """The buckets ``warmup`` with these arguments would compile (those not compiled yet), as jobs for a
        ``Compiler`` (several caches' jobs can share one pool)."""
        bound = self._bind(example_args, example_kwargs)
        return [CompileJob(self, key, bound) for key in self._warmup_keys(bound, keep) if key not in self._entries]

    def schedule(self, key: BucketKey, compiler: Compiler) -> concurrent.futures.Future | None:
        """Marks ``key`` as compiled by ``compiler`` (a call needing it then hurries it and waits); the
        future it completes, or None when the bucket is compiled or scheduled already."""
        with self._lock:
            if key in self._entries or key in self._scheduled:
                return None
            future = concurrent.futures.Future()
            self._scheduled[key] = (future, compiler)
            self._warmed_up = True
            return future

    def unschedule(self, key: BucketKey) -> None:
        """Drops ``key``'s schedule (its compiler stopped): a call needing it compiles it where it runs."""
        with self._lock:
            future, _ = self._scheduled.pop(key, (None, None))
        if future is not None:
            future.cancel()

    @property
    def scheduled(self) -> int:
        """Buckets a ``Compiler`` is still to compile."""
        return len(self._scheduled)

    def compile_job(self, key: BucketKey, example: dict[str, Any], *, prime: bool = False) -> int:
        """Compiles bucket ``key`` from bound example arguments (a ``CompileJob``'s), completes its
        schedule, and logs it when it was scheduled in the background (after a warm-up); returns the
        XLA compiles (0: compiled already). ``prime``: the executable also runs once on zero arguments
        (``_prime``) before a call can use it."""
        future, _ = self._scheduled.get(key, (None, None))
        if key in self._entries:
            return 0
        start = time.perf_counter()
        try:
            abstract = self._abstract_args(example, key)
            entry, compiles = self._compile_one(key, abstract)
            if prime:
                self._prime(key, entry, abstract)
        except BaseException as error:
            with self._lock:
                self._scheduled.pop(key, None)
            if future is not None:
                future.set_exception(error)
            raise
        with self._lock:
            self._entries[key] = entry
            self._scheduled.pop(key, None)
        if future is not None and not future.cancelled():
            future.set_result(entry)
        logger.info("[%s] compiled (%s) in %.2fs on %s", self.name, self.describe(key), time.perf_counter() - start,
                    threading.current_thread().name)
        return compiles

    def _prime(self, key: BucketKey, entry: _Entry, abstract: dict[str, Any]) -> None:
        """Runs ``entry``'s executable once on zeros of its abstract arguments (at most
        ``PRIME_MAX_BYTES``; donated ones are fresh zeros, and the outputs are dropped), so that a call's
        first run costs what later ones do; marks it run. A failure is logged, never raised."""
        def zeros(leaf: Any) -> Any:      # on the leaf's sharding (None: the default device)
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                return leaf
            return jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)

        start, values = time.perf_counter(), self._dynamic_values(abstract)
        try:
            if sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(values)
                   if isinstance(leaf, jax.ShapeDtypeStruct)) > PRIME_MAX_BYTES:
                return
            jax.block_until_ready(entry.executable(*jax.tree.map(zeros, values)))
        except Exception as error:  # noqa: BLE001 - priming is an optimisation: the first call runs it instead
            logger.warning("%s: priming bucket (%s) failed, its first call runs it: %s", self.name,
                           self.describe(key), _error_lines(error))
            return
        entry.ran = True
        logger.info("[%s] primed (%s) in %.2fs", self.name, self.describe(key), time.perf_counter() - start)

    def can_run(self, key: BucketKey, call: BucketKey) -> bool:
        """Whether bucket ``key``'s executable can run a call planned as ``call``: the same arguments
        given, every dim at least as large, every static equal or its stand-in (``stand_ins``)."""
        return key[2] == call[2] and all(a >= b for a, b in zip(key[0], call[0])) and all(
            mine == theirs or self.stand_ins.get(arg, {}).get(theirs, _NONE) == mine
            for arg, mine, theirs in zip(self.static_argnames, key[1], call[1]))

    def ready_plan(self, plan: BucketPlan) -> BucketPlan:
        """The plan to run now for ``plan``: itself when its executable exists or nothing is scheduled in the
        background; else the smallest compiled bucket that can run it (``can_run``: at least as large in
        every dim, the same statics or their stand-ins): the call runs padded to it instead of waiting;
        else ``plan`` (the call hurries its own bucket and waits for it)."""
        if plan.key is None or not self._scheduled or plan.key in self._entries:
            return plan
        runners = [k for k in list(self._entries) if self.can_run(k, plan.key)]
        if not runners:
            return plan
        key = min(runners, key=lambda k: (int(np.prod(k[0])), k[1] != plan.key[1], k[0]))
        self.stats.borrowed += 1
        return BucketPlan(key, plan.real, dict(zip(self.dims, key[0])), dict(zip(self.static_argnames, key[1])))

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

    def _await_scheduled(self, key: BucketKey) -> _Entry | None:
        """The executable of a bucket scheduled on a ``Compiler``: hurried to the front and waited for
        (logged); None when it is not scheduled (or its compiler stopped)."""
        with self._lock:
            future, compiler = self._scheduled.get(key, (None, None))
        if future is None:
            return self._entries.get(key)
        logger.warning("%s: waiting for bucket (%s), compiling in the background: no larger bucket is compiled "
                       "yet", self.name, self.describe(key))
        compiler.hurry(self, key)
        self.stats.waits += 1
        try:
            with compiler.waited_on():
                return future.result()
        except concurrent.futures.CancelledError:
            return self._entries.get(key)

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
