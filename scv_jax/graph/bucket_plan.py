"""Bucket choice for graph mode (host side only: no device transfers): which bucket a call lands in
(``BucketPlan``), from the static shapes of its arguments and its Python values, every bucket a warm-up
compiles, and a bucket's abstract arguments. ``BucketPlanner`` is the host half of ``ExecutableCache``.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from scv_jax.graph.buckets import Buckets, Pad, array_leaves, as_buckets, is_array_leaf, map_arrays, real_size

# (dim buckets in ``dims`` order, static values in ``static_argnames`` order, names of the arguments
# given and not None: optional arguments change the executable's signature)
BucketKey = tuple


class BucketPlan(NamedTuple):
    """Where one call lands. ``key`` is None when a size exceeds the largest bucket."""

    key: BucketKey | None
    real: dict[str, int]        # dim -> unpadded size
    padded: dict[str, int]      # dim -> bucket size
    statics: dict[str, Any]     # static argument -> (bucketed) value


_NONE = object()               # no stand-in


class BucketPlanner:
    """An ``ExecutableCache``'s step signature, dims, pads and statics (the arguments are the cache's,
    checked against ``fn``'s parameters), and what follows from them: a call's bucket (``plan``), every
    bucket (``all_keys``), which compiled bucket can run a call (``can_run``) and a bucket's abstract
    arguments."""

    def __init__(self, fn: Callable, *,
                 dims: Mapping[str, Buckets | Sequence[int] | Callable[[dict[str, Any]], int]],
                 pads: Mapping[str, Pad | Sequence[Pad]],
                 bucketed_statics: Mapping[str, Buckets | Sequence[int]] | None = None,
                 static_argnames: Sequence[str] = (), donate_argnames: Sequence[str] = (),
                 masks: Mapping[str, str] | None = None, keep: Callable[[dict[str, int]], bool] | None = None,
                 stand_ins: Mapping[str, Mapping[Any, Any]] | None = None, name: str | None = None,
                 split_dims: Sequence[str] = ()):
        self.fn = fn              # the step function (``jax.eval_shape`` of its outputs)
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

    def describe(self, key: BucketKey) -> str:
        """``key`` as ``"dim=size, ..., static=value, ..."`` (dims, then statics)."""
        dims, statics, _ = key
        parts = [f"{d}={s}" for d, s in zip(self.dims, dims)]
        parts += [f"{a}={v}" for a, v in zip(self.static_argnames, statics)]
        return ", ".join(parts)

    def can_run(self, key: BucketKey, call: BucketKey) -> bool:
        """Whether bucket ``key``'s executable can run a call planned as ``call``: the same arguments
        given, every dim at least as large, every static equal or its stand-in (``stand_ins``)."""
        return key[2] == call[2] and all(a >= b for a, b in zip(key[0], call[0])) and all(
            mine == theirs or self.stand_ins.get(arg, {}).get(theirs, _NONE) == mine
            for arg, mine, theirs in zip(self.static_argnames, key[1], call[1]))

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
