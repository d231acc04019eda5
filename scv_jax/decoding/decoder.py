"""``SpeculativeDecoder``: offline decoding of a batch of prompts (``generate``) through an ``Engine``,
over one ``StepRunner`` (the models split for the step functions, their paged caches, compiled step
executables, adaptive controllers and warm-up) that every call reuses.

    target, draft = scv_jax.models.load_demo()
    decoder = scv_jax.SpeculativeDecoder(target, draft, config=scv_jax.DecoderConfig(k=4))
    out = decoder.generate([list(b"def main(")], max_new_tokens=64)
    out.tokens[0], out.stats.tokens_per_second

    ngram = scv_jax.SpeculativeDecoder(target, scv_jax.NgramDrafter(min_n=1, max_n=3))  # or "ngram"

All per-request state (tokens, lags, block tables, sampling rows) lives on the host in arrays
(``RequestBatch``, held by the engine's scheduler); the device holds the two paged caches and the model
weights. Each step is one call into a graph-mode executable (its inputs built at bucket size, its bucket
planned once per shape) and one batched device-to-host fetch of the emitted tokens. With ``mesh=`` the
weights, caches and batch are spread over a device mesh (``placement``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from scv_jax.arguments import require_int
from scv_jax.decoding.config import DecoderConfig
from scv_jax.decoding.engine import Engine, build_runner
from scv_jax.decoding.placement import ShardingConfig
from scv_jax.decoding.requests import check_eos, check_prompts, check_seed
from scv_jax.decoding.runner import is_temperature
from scv_jax.decoding.stats import GenerateStats
from scv_jax.graph.compile_counter import CompileCounter
from scv_jax.graph.stats import GraphModeStats
from scv_jax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class GenerateOutput(NamedTuple):
    """tokens: the generated tokens of each prompt (prompt excluded, EOS included); stats."""

    tokens: list[list[int]]
    stats: GenerateStats


def _request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a ``generate`` call with ``seed``: in [0, 2**63), one per pair."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> np.uint64(1))


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with a drafter (or plain decoding without one): the offline API
    over an ``Engine``'s roles, holding the ``StepRunner`` (models, caches, executables, controllers) that
    every ``generate`` call's engine runs on.

    ``draft`` is a draft model (a ``scv_jax.models.PagedModel`` with the target's vocabulary), a
    ``HostDrafter`` (e.g. ``NgramDrafter``, prompt lookup; ``"ngram"`` is ``NgramDrafter()``; or your own),
    or None. Models are split once; the step functions are pure functions of their parameters, compiled
    per shape bucket by ``ExecutableCache``. Greedy output equals autoregressive decoding of the target
    token for token; with temperature > 0, rejection sampling keeps the target's distribution.

    ``mesh``: a ``jax.sharding.Mesh`` with axes ("data", "model") (e.g. ``scv_jax.decoder_mesh(2, 4)``)
    to run on: the target tensor-parallel over "model", requests and their cache blocks split over
    "data" (``scv_jax.decoding.placement``; both models must then be ``scv_jax.models.Transformer`` instances,
    or the draft an EAGLE-3 head, replicated).
    ``sharding``: a ``ShardingConfig`` (draft placement, vocabulary-parallel embeddings) for the mesh.
    """

    def __init__(self, target, draft=None, *, config: DecoderConfig | None = None, mesh=None,
                 sharding: ShardingConfig | None = None):
        self.runner = build_runner(target, draft, config=config, mesh=mesh, sharding=sharding)
        self.config = self.runner.config
        self.vocab_size = self.runner.vocab_size
        self.max_position_embeddings = self.runner.max_position_embeddings
        self._reported: set[str] = set()      # compilations after warm-up already logged

    @property
    def graph_stats(self) -> dict[str, GraphModeStats]:
        """Graph-mode counters of the prefill and decode executables (hits, compiles, donations, ...)."""
        return self.runner.graph_stats

    @property
    def drafter(self):
        """The host drafter (a ``HostDrafter``; ``"ngram"`` made an ``NgramDrafter``), or None (a draft model
        or none)."""
        return self.runner.proposer.host

    @property
    def controllers(self) -> dict:
        """The adaptive controllers by kind of step ("greedy", "sampling"); empty without ``adaptive``."""
        return self.runner.controllers

    @property
    def pool(self):
        """The KV block pools (one per data shard)."""
        return self.runner.pool

    def warmup(self, batch_sizes: int | Sequence[int], max_len: int, *,
               temperatures: float | Sequence[float] = 0.0, logprobs: bool = False, progress: bool = False,
               workers: int | None = None) -> int:
        """``StepRunner.warmup``: compiles ahead of time (``workers`` threads, default the cores) every
        executable ``generate`` runs for up to ``max(batch_sizes)`` requests at once of up to ``max_len``
        positions at ``temperatures``; returns the executables XLA compiled or loaded from the persistent
        cache. A ``generate`` within these sizes then compiles nothing."""
        return self.runner.warmup(batch_sizes, max_len, temperatures=temperatures, logprobs=logprobs,
                                  progress=progress, workers=workers)

    def device_seconds_per_step(self, batch_size: int, k: int, *, greedy: bool = True, context: int | None = None,
                                calls: int = 20, repeats: int = 5, controlled: int = 0) -> float:
        """``StepRunner.device_seconds_per_step``: seconds per decode step of one shape with no host work
        (``controlled``: how many of the requests have logit controls)."""
        return self.runner.device_seconds_per_step(batch_size, k, greedy=greedy, context=context, calls=calls,
                                                   repeats=repeats, controlled=controlled)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None, temperature: float = 0.0,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None, *,
                 max_num_seqs: int | None = None, progress: bool = False,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens for each prompt (a batch of any lengths): a loop over
        an ``Engine`` with every prompt added at once.

        A request stops at ``max_new_tokens`` or after emitting an ``eos_token_id`` (one id or a
        sequence of ids, e.g. Llama-3-Instruct's three); its KV blocks go back to the pool. A prompt
        plus ``max_new_tokens`` may not exceed the models' ``config.max_position_embeddings`` (where
        they declare one). ``temperature`` 0 is greedy; otherwise sampling with ``seed``, an int in
        [0, 2**32) (same seed, same output; request i draws from its own stream of (seed, i)).
        ``sampling``: instead of ``max_new_tokens`` and ``temperature``, each request's
        ``SamplingParams`` (one for all, or one per prompt; their max_tokens, filters, stop ids and
        seeds; a request without a seed draws from (seed, i)). ``max_num_seqs``: at most that many
        requests decode at once (continuous batching: the others wait, in order, and each is
        prefilled and joins the running batch as soon as a running request finishes; None: all at
        once). Either way at most the largest batch bucket run at once (``DecoderConfig.batch_buckets``;
        on a mesh, its share per data shard): a step never outgrows the compiled executables.
        ``progress``: report the prefill of long prompts on stderr. ``on_tokens(prompt_index,
        new_tokens)``: called after each step for each request that emitted tokens (streaming; the
        tokens of ``GenerateOutput.tokens``, in order; an exception it raises stops the call).
        """
        if not is_temperature(temperature):
            raise ValueError(f"generate: temperature must be a finite float >= 0, got {temperature!r}")
        seed = check_seed(seed)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"generate: on_tokens must be None or a callable(prompt_index, tokens), got {on_tokens!r}")
        if max_num_seqs is not None:
            require_int("generate", "max_num_seqs", max_num_seqs, minimum=1)
        prompt_ids = check_prompts(prompts, self.vocab_size)
        params = self._request_params(len(prompt_ids), max_new_tokens, temperature, seed, sampling)
        engine = Engine(self, eos_token_id=check_eos(eos_token_id, self.vocab_size), max_num_seqs=max_num_seqs,
                        progress=progress, lockstep=True)
        for i, (prompt, request) in enumerate(zip(prompt_ids, params)):
            try:
                engine.add_request(prompt, request, request_id=str(i))
            except ValueError as error:
                raise ValueError(f"generate: prompt {i}: {str(error).removeprefix('add_request: ')}") from None
        tokens: list[list[int]] = [[] for _ in prompt_ids]
        start = time.perf_counter()
        with CompileCounter() as compiles:
            try:
                while engine.has_unfinished():
                    for out in engine.step():
                        index = int(out.request_id)
                        tokens[index] += out.new_token_ids
                        if on_tokens is not None and out.new_token_ids:
                            on_tokens(index, list(out.new_token_ids))
                engine.finish_observing()
            finally:
                engine.abort_all()
        stats = engine.stats
        stats.wall_seconds = time.perf_counter() - start
        stats.compile_count = compiles.count
        # the step executables' compilations are listed by bucket (``_run``) and logged by their cache
        steps = {self.runner.prefill_executable.jit_name, self.runner.decode_executable.jit_name}
        others = [name for name in compiles.names if name not in steps]
        stats.compiled += others
        for name in others if self.runner.warmed_up else ():
            if name not in self._reported:
                self._reported.add(name)
                logger.warning("generate: compiled %s after warm-up (a computation warm-up did not cover)", name)
        stats.generated_tokens = sum(map(len, tokens))
        stats.tokens_per_second = stats.generated_tokens / max(stats.wall_seconds - stats.compile_seconds, 1e-9)
        engine.tally.fill(stats)
        return GenerateOutput(tokens, stats)

    @staticmethod
    def _request_params(count: int, max_new_tokens: int | None, temperature: float, seed: int,
                        sampling: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        """Each of ``count`` requests' ``SamplingParams`` for ``generate``; request i's stream, unless its
        params give a seed, is the one of (seed, i)."""
        if sampling is None:
            require_int("generate", "max_new_tokens", max_new_tokens, minimum=1)
            sampling = SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens))
        elif max_new_tokens is not None or temperature != 0.0:
            raise ValueError("generate: with sampling=, give max_tokens and temperature in its SamplingParams "
                             "(leave max_new_tokens and temperature out)")
        params = [sampling] * count if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"generate: sampling must be a SamplingParams or a sequence of one per prompt "
                             f"({count}), got {sampling!r}")
        return [p if p.seed is not None else dataclasses.replace(p, seed=_request_seed(seed, i))
                for i, p in enumerate(params)]


def generate_autoregressive(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            temperature: float = 0.0, seed: int = 0,
                            eos_token_id: int | Sequence[int] | None = None,
                            *, config: DecoderConfig | None = None) -> GenerateOutput:
    """Plain decoding of ``model`` through the same paged-cache code (the baseline).

    Builds a ``SpeculativeDecoder(model, None)``; to decode repeatedly without recompiling, build one
    yourself and call its ``generate``.
    """
    decoder = SpeculativeDecoder(model, None, config=config)
    return decoder.generate(prompts, max_new_tokens, temperature, seed, eos_token_id)
