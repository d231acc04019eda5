"""What ``scv-jax generate`` and ``scv-jax serve`` share before they decode: the checkpoints, drafter and
models their flags name (``--model`` / ``--revision``, ``--draft`` / ``--draft-revision``, ``--eagle3`` /
``--eagle3-revision``, ``--ngram`` with ``--ngram-min`` / ``--ngram-max``, ``--suffix`` with
``--suffix-*``, ``--dtype``) and the check that the KV caches fit the memory, whose error names the running
command's flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from scv_jax.decoding.config import DecoderConfig
    from scv_jax.decoding.proposers.base import HostDrafter
    from scv_jax.decoding.proposers.ngram import NgramDrafter


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """The directories of ``--model``, ``--draft`` and ``--eagle3`` (None: not given): a local directory as
    given, a Hugging Face Hub id's snapshot at ``--revision`` / ``--draft-revision`` /
    ``--eagle3-revision`` (downloaded, or found in the cache)."""

    model: pathlib.Path
    draft: pathlib.Path | None
    eagle3: pathlib.Path | None


def _checkpoint(path_or_id: str, revision: str | None, flag: str) -> pathlib.Path:
    """``checkpoint_dir`` of a flag's value; its error starts with the flag."""
    from scv_jax.models.hub import checkpoint_dir

    try:
        return checkpoint_dir(path_or_id, revision=revision)
    except (ValueError, OSError) as error:
        raise ValueError(f"{flag} {error}") from None


def checkpoints(args: argparse.Namespace) -> Checkpoints:
    """The ``Checkpoints`` of ``--model``, ``--draft`` and ``--eagle3``, each resolved once (a Hub id's
    files are then read from one commit). Raises ValueError naming the flag for a mistake."""
    optional = (("--draft", args.draft, args.draft_revision), ("--eagle3", args.eagle3, args.eagle3_revision))
    for flag, path, revision in optional:
        if revision is not None and not path:
            raise ValueError(f"{flag}-revision needs {flag}")
    return Checkpoints(_checkpoint(args.model, args.revision, "--model"),
                       *(_checkpoint(path, revision, flag) if path else None for flag, path, revision in optional))


@dataclasses.dataclass(frozen=True)
class Models:
    """The loaded models: the target, the drafter (a draft model, an EAGLE-3 head, a ``HostDrafter`` or
    None: target only), the models that hold KV caches (the target, then a draft model or head) and
    ``position_limit``, the smallest ``max_position_embeddings`` among those with the directory whose
    config.json sets it (None: no limit)."""

    target: Any
    drafter: Any
    cached: tuple[Any, ...]
    position_limit: tuple[int, pathlib.Path] | None


def ngram_drafter(args: argparse.Namespace) -> NgramDrafter:
    """The ``NgramDrafter`` of ``--ngram-min`` / ``--ngram-max`` (checked even without ``--ngram``)."""
    from scv_jax.decoding.proposers.ngram import NgramDrafter

    if args.ngram_min > args.ngram_max:
        raise ValueError(f"--ngram-min ({args.ngram_min}) must be <= --ngram-max ({args.ngram_max})")
    return NgramDrafter(min_n=args.ngram_min, max_n=args.ngram_max)


def host_drafter(args: argparse.Namespace) -> HostDrafter | None:
    """The host drafter the flags name: ``--ngram``'s ``NgramDrafter`` (its sizes checked even without the
    flag), ``--suffix``'s ``SuffixDrafter`` or None."""
    from scv_jax.decoding.proposers.suffix import SuffixDrafter

    ngram = ngram_drafter(args)
    if args.ngram:
        return ngram
    if args.suffix:
        return SuffixDrafter(max_depth=args.suffix_max_depth, max_spec_factor=args.suffix_max_spec_factor,
                             min_token_prob=args.suffix_min_token_prob,
                             max_cached_requests=args.suffix_max_cached_requests)
    return None


def load_models(args: argparse.Namespace, dirs: Checkpoints) -> Models:
    """The target of ``--model`` and the drafter of ``--draft`` / ``--eagle3`` / ``--ngram`` / ``--suffix``
    (the models from ``dirs``), in ``--dtype``; the drafter's settings are checked before any weights
    load. Raises ValueError naming the flag for a mistake."""
    from scv_jax.models import load_eagle3, load_hf

    host = host_drafter(args)
    target = load_hf(dirs.model, dtype=args.dtype)
    if dirs.eagle3 is not None:
        head = load_eagle3(dirs.eagle3, target, dtype=args.dtype)
        return Models(target, head, (target, head), _position_limit([(target, dirs.model), (head, dirs.eagle3)]))
    if dirs.draft is None:
        return Models(target, host, (target,), _position_limit([(target, dirs.model)]))
    draft = load_hf(dirs.draft, dtype=args.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--draft {args.draft} has vocab_size {draft.config.vocab_size}, the target "
                         f"{args.model} has {target.config.vocab_size}: they must share the vocabulary")
    return Models(target, draft, (target, draft), _position_limit([(target, dirs.model), (draft, dirs.draft)]))


def _position_limit(models: list[tuple[Any, pathlib.Path]]) -> tuple[int, pathlib.Path] | None:
    """The smallest ``max_position_embeddings`` of (model, directory) pairs and its directory."""
    limits = [(limit, path) for model, path in models
              if (limit := getattr(model.config, "max_position_embeddings", None)) is not None]
    return min(limits, key=lambda pair: pair[0], default=None)


def _memory_bytes() -> tuple[int, str]:
    """(bytes, where): the default device's free memory, or the host's physical memory (CPU)."""
    import jax

    memory = device_memory()
    if memory is not None:
        return memory[0] - memory[1], f"free on {jax.local_devices()[0].device_kind}"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of host memory"


def device_memory() -> tuple[int, int] | None:
    """(bytes this process's first device may use, bytes in use) when it reports them (a GPU), else None (a CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return (stats["bytes_limit"], stats.get("bytes_in_use", 0)) if "bytes_limit" in stats else None


def kv_bytes_per_position(models: Sequence, cache_dtype: str) -> int:
    """Bytes one cache position takes: K and V, every layer of each of ``models``."""
    from scv_jax.ops.commit.kv_cache import parse_cache_dtype

    per_position = sum(2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim for m in models)
    return per_position * parse_cache_dtype(cache_dtype).itemsize


def check_memory(config: DecoderConfig, models: Sequence, *, flag: str, advice: str) -> None:
    """Raises ValueError before the caches are allocated when they would not fit the memory: K and V,
    every layer of each of ``models``, ``config.num_blocks`` blocks. ``flag`` (the running command's
    flag that sized them) starts the message and ``advice`` (which of its flags to change) ends it."""
    positions = config.num_blocks * config.block_size
    needed = positions * kv_bytes_per_position(models, config.cache_dtype)
    available, where = _memory_bytes()
    if needed > available:
        raise ValueError(f"{flag}: the KV caches for {positions} positions need {needed / 2**30:.1f} GiB, "
                         f"more than the {available / 2**30:.1f} GiB {where}; {advice}")
