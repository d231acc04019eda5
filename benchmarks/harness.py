"""Timing utilities shared by the benchmarks: medians of async-dispatched calls (per-call time, host
dispatch included), device time of chained calls inside one executable, device ceilings, machine
description and RESULTS.md appending. Imported by the scripts in this folder."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scv_jax.demo.report import append_markdown, machine, results_header  # noqa: F401 (machine: for gpu_suite)

RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def median_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median wall seconds per call of ``fn``: each sample dispatches ``inner`` calls back to back and
    waits once, so per-call host overhead overlaps device work as in a real decode loop."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner - 1):
            fn()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) / inner)
    return float(np.median(samples))


def device_seconds(fn: Callable[..., Any], args: tuple, *, updates_first_arg: bool = False,
                   iterations: int = 20, repeats: int = 5) -> float:
    """Device seconds per call of ``fn(*args)``, without host dispatch: the figure inside a fused step.

    ``iterations`` and ``2 * iterations`` dependent calls each run inside one jitted ``lax.fori_loop``
    executable; the result is the difference of their fastest times (over ``repeats``) divided by
    ``iterations``, so the
    executable's fixed costs (its launch, copying the inputs into the loop state, the host's wait)
    cancel out. Each call's inputs pass through an optimization barrier together with the previous
    call's output, so XLA can neither hoist a call out of the loop nor drop it. With
    ``updates_first_arg`` ``fn(state, *rest)`` returns the next ``state`` (e.g. a KV cache updated in
    place), which feeds the next call. Inputs are otherwise the same every call (L2-resident when
    small, as in a CUDA-graph replay).
    """
    args = tuple(args)
    if updates_first_arg:
        def step(carry):
            return lax.optimization_barrier((fn(*carry),) + carry[1:])
        init = args
    else:
        def step(carry):
            inputs, _ = carry
            out, inputs = lax.optimization_barrier((fn(*inputs), inputs))
            return inputs, out
        init = (args, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, *args)))

    loop = jax.jit(lambda carry, n: lax.fori_loop(0, n, lambda _, c: step(c), carry))   # n traced: one compile

    def fastest(n: int) -> float:   # the minimum over repeats: the least disturbed by other load
        count = jnp.int32(n)
        jax.block_until_ready(loop(init, count))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(loop(init, count))
            samples.append(time.perf_counter() - start)
        return min(samples)
    return max(fastest(2 * iterations) - fastest(iterations), 0.0) / iterations


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 10, inner: int = 5) -> float:
    """Device copy bandwidth in bytes/s (read + write) of a donated, jitted ``x + 1``, best of an
    in-place update and a fresh output (XLA picks different loops for the two)."""
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    holder = [jnp.zeros(num_bytes // 4, jnp.uint32)]

    def once():
        holder[0] = step(holder[0])
        return holder[0]
    fresh = jax.jit(lambda a: a + 1)
    source = jnp.zeros(num_bytes // 4, jnp.uint32)
    seconds = min(median_seconds(once, repeats, inner), median_seconds(lambda: fresh(source), repeats, inner))
    return 2 * num_bytes / seconds


def launch_floor(repeats: int = 20, inner: int = 50) -> float:
    """Seconds per call of the cheapest jitted op (one tiny kernel): the floor of any op's time."""
    step = jax.jit(lambda a: a + 1)
    x = jnp.zeros((8,), jnp.int32)
    return median_seconds(lambda: step(x), repeats, inner)


def append_results(text: str) -> None:
    """Appends ``text`` to benchmarks/RESULTS.md."""
    append_markdown(RESULTS_PATH, text)


def publish(script: str, title: str, details: str, body: str, *, append: bool,
            argv: list[str] | None = None) -> None:
    """Prints ``body`` under a results header (date, machine, versions, the command that ran
    ``script`` with ``argv``, default this process's arguments) and appends it to RESULTS.md when
    ``append``."""
    command = "python " + " ".join([os.path.relpath(script, os.getcwd())] + (argv or sys.argv[1:]))
    text = results_header(title, command, details) + body.rstrip("\n") + "\n"
    print(text)
    if append:
        append_results(text)
