"""``scv-jax serve``: loads the checkpoint(s), builds an ``Engine``, compiles the largest bucket of each
kind of step (progress on stderr), then serves the app with uvicorn and prints ``scv-jax serve: listening
on http://HOST:PORT`` on stdout while the other buckets compile in the background (``Engine.start_warmup``:
steps meanwhile run padded to a compiled bucket; the compiler stops at shutdown).

SIGINT / SIGTERM: uvicorn stops accepting connections and lets in-flight requests finish for up to
``--shutdown-timeout`` seconds; then the engine loop stops, which ends each request still running with
a 503 (a stream: OpenAI's error object, then ``[DONE]``), and the process exits with status 0.

Several processes (``serving.multihost``): process 0 serves as above, the others follow its engine; all
compile every step before serving (a background compile would let the processes pick different
executables), and process 0's shutdown ends them too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    from scv_jax.decoding.config import DecoderConfig
    from scv_jax.launch import Checkpoints, Models

DEFAULT_MAX_MODEL_LEN = 2048     # the context served when --max-model-len is not given (at most the model's)
CANCEL_AFTER_SECONDS = 10        # past --shutdown-timeout, uvicorn cancels what has still not ended


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, then it: the batch sizes steps are padded to."""
    return tuple(1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs) + (max_num_seqs,)


def parse_mesh(text: str) -> tuple[int, int]:
    """``--mesh DATA,MODEL`` -> (data, model); ValueError naming the flag otherwise."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--mesh must be DATA,MODEL (two ints >= 1, e.g. 1,8), got {text!r}")
    return int(parts[0]), int(parts[1])


@dataclasses.dataclass
class Served:
    """An engine and what the server needs to know of it."""

    engine: Any
    max_model_len: int
    vocab_size: int


class Pool(NamedTuple):
    """The KV-cache pool ``serve`` allocates: its blocks, the flag that sized them, a line for the log."""

    num_blocks: int
    flag: str
    summary: str


def pool_blocks(args: argparse.Namespace, cached_models: list, max_model_len: int, data_shards: int) -> Pool:
    """The KV-cache pool (its summary tells the requests of ``max_model_len`` it holds at once at worst):
    ``--num-blocks``; ``--kv-cache-memory`` bytes; or
    ``--gpu-memory-utilization`` of the device's memory less what is in use (the weights; default 0.9 on a
    device that reports its memory); on a CPU by default ``--max-num-seqs`` requests of ``max_model_len``.
    A multiple of the mesh's data shards. Raises ValueError naming the flag when they hold no request."""
    from scv_jax.decoding.config import DecoderConfig
    from scv_jax.launch import device_memory, kv_bytes_per_position

    block_size = DecoderConfig.block_size
    block_bytes = kv_bytes_per_position(cached_models, args.dtype) * block_size
    per_request = -(-max_model_len // block_size)
    memory = device_memory()
    if args.num_blocks:
        num_blocks, flag = args.num_blocks, "--num-blocks"
    elif args.kv_cache_memory:
        num_blocks, flag = args.kv_cache_memory // block_bytes, "--kv-cache-memory"
    elif args.gpu_memory_utilization is not None or memory is not None:
        flag = "--gpu-memory-utilization"
        if memory is None:
            raise ValueError(f"{flag}: this device does not report its memory (a CPU): pass --kv-cache-memory "
                             "BYTES or --num-blocks")
        utilization = 0.9 if args.gpu_memory_utilization is None else args.gpu_memory_utilization
        limit, in_use = memory
        num_blocks = max(int(utilization * limit) - in_use, 0) // block_bytes
    else:
        num_blocks, flag = args.max_num_seqs * per_request, "--max-num-seqs"
    if flag != "--num-blocks":          # as given, else a multiple of the data shards
        num_blocks -= num_blocks % data_shards
    if flag != "--num-blocks" and num_blocks < per_request * data_shards:
        raise ValueError(f"{flag}: the KV cache holds {num_blocks} blocks of {block_size} positions "
                         f"({block_bytes} bytes each), fewer than one request of --max-model-len {max_model_len} "
                         f"needs on each of {data_shards} data shard(s) ({per_request}): give it more memory or "
                         "lower --max-model-len")
    return Pool(num_blocks, flag, f"KV cache: {num_blocks} blocks of {block_size} positions "
                f"({num_blocks * block_bytes / 2 ** 30:.2f} GiB, sized by {flag}): {num_blocks // per_request} "
                f"requests of --max-model-len {max_model_len} at once at worst, more as blocks are allocated on "
                f"demand (--max-num-seqs {args.max_num_seqs})")


def engine_config(args: argparse.Namespace, models: Models, data_shards: int = 1) -> tuple[DecoderConfig, int, Pool]:
    """(the ``DecoderConfig``, the context served, the KV pool) that ``serve``'s flags ``args`` give ``models``
    (as ``launch.load_models`` returns them; abstract ones will do: only their configs are read) on
    ``data_shards`` data shards. Raises ValueError naming the flag for a bad one."""
    from scv_jax.decoding.config import DecoderConfig

    limit = models.position_limit[0] if models.position_limit is not None else None
    max_model_len = args.max_model_len or min(limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    pool = pool_blocks(args, models.cached, max_model_len, data_shards)
    drafting = models.drafter is not None
    config = DecoderConfig(k=args.k if drafting else 0, adaptive=args.adaptive and drafting,
                           batch_buckets=batch_buckets(args.max_num_seqs), max_seq_len=max_model_len,
                           num_blocks=pool.num_blocks, cache_dtype=args.dtype, packed_verify=args.packed_verify,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           overlap=getattr(args, "overlap", True), draft_ahead=getattr(args, "draft_ahead", False))
    return config, max_model_len, pool


def make_engine(args: argparse.Namespace, dirs: Checkpoints, tokenizer=None, *,
                several_processes: bool = False) -> Served:
    """The ``Engine`` of ``args`` with the models of ``dirs`` (not warmed up), ``tokenizer`` for structured
    output (None: none); ``several_processes``: the job has several (the mesh must span them). Raises
    ValueError naming the flag for a bad one."""
    from scv_jax.launch import check_memory, load_models
    from scv_jax.models.hf import eos_token_ids

    mesh_shape = parse_mesh(args.mesh) if args.mesh else None
    if several_processes:
        from scv_jax.serving.multihost import check_mesh
        check_mesh(mesh_shape)
    models = load_models(args, dirs)
    config, max_model_len, pool = engine_config(args, models, mesh_shape[0] if mesh_shape else 1)
    flag = pool.flag
    check_memory(config, models.cached, flag=flag, advice=f"lower {flag}" if flag != "--max-num-seqs" else
                 "lower --max-num-seqs or --max-model-len, or pass --kv-cache-memory or --num-blocks")
    print(pool.summary, file=sys.stderr, flush=True)
    mesh = None
    if mesh_shape is not None:
        from scv_jax import decoder_mesh
        mesh = decoder_mesh(*mesh_shape)
    from scv_jax import Engine

    engine = Engine(models.target, models.drafter, config=config, mesh=mesh,
                    eos_token_id=eos_token_ids(dirs.model) or None, tokenizer=tokenizer)
    return Served(engine, max_model_len, models.target.config.vocab_size)


def warmup_sizes(args: argparse.Namespace, served: Served) -> dict[str, Any]:
    """What ``serve`` compiles ahead of time: ``Engine.start_warmup``'s (and ``Engine.warmup_jobs``')
    arguments for ``args``' flags."""
    return dict(max_num_seqs=args.max_num_seqs, max_len=served.max_model_len,
                logprobs=served.engine.supports_logprobs,
                structured_output=served.engine.supports_structured_output)


def _uvicorn_server(app, host: str, port: int, grace: float, end_requests: Callable[[], None]):
    """uvicorn's server of ``app``; at shutdown, ``end_requests()`` runs once in-flight requests had
    ``grace`` seconds to finish."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that prints its address once listening, ends the requests still running
        after the grace period, and exits normally on a signal (uvicorn re-raises SIGINT / SIGTERM after
        its graceful shutdown, which would end the process with the signal's status)."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                print(f"scv-jax serve: listening on http://{bound[0]}:{bound[1]}", flush=True)

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            timer = asyncio.get_running_loop().call_later(grace, end_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace + CANCEL_AFTER_SECONDS, lifespan="on")
    return Server(config)


def serve(args: argparse.Namespace) -> int:
    """Runs ``scv-jax serve`` until SIGINT / SIGTERM; 0 after a clean shutdown."""
    from scv_jax.launch import checkpoints
    from scv_jax.models import load_tokenizer
    from scv_jax.serving.app import ServingContext, build_app
    from scv_jax.serving.chat import load_chat_template
    from scv_jax.serving.engine_loop import EngineLoop
    from scv_jax.serving.metrics import ServerMetrics
    from scv_jax.serving.multihost import check_same_flags, follow, join, release_followers, watch_job

    several = join(args)
    if several:
        check_same_flags(args)
        if args.no_warmup:
            raise ValueError("--no-warmup: over several processes every step compiles before the server starts (a "
                             "step compiled while the processes run others may never end)")
    dirs = checkpoints(args)
    tokenizer = load_tokenizer(dirs.model)
    chat_template = load_chat_template(dirs.model)
    served = make_engine(args, dirs, tokenizer, several_processes=several)
    if tokenizer.vocab_size > served.vocab_size:
        raise ValueError(f"--model {args.model}: its tokenizer has {tokenizer.vocab_size} ids, the model's "
                         f"vocab_size is {served.vocab_size}")
    compiler = None
    if several:         # every executable before any step: each process must pick the same ones
        print(f"compiling (one time): up to {args.max_num_seqs} requests of up to {served.max_model_len} tokens ...",
              file=sys.stderr, flush=True)
        served.engine.warmup(**warmup_sizes(args, served), progress=True)
        if not served.engine.is_leader:
            return follow(served.engine)
    elif not args.no_warmup:
        print(f"compiling (one time): up to {args.max_num_seqs} requests of up to {served.max_model_len} tokens ...",
              file=sys.stderr, flush=True)
        compiler = served.engine.start_warmup(**warmup_sizes(args, served), progress=True)
    name = args.served_model_name or args.model
    metrics = ServerMetrics(name)
    engine_loop = EngineLoop(served.engine, metrics.observe_engine)
    ctx = ServingContext(engine_loop=engine_loop, tokenizer=tokenizer, chat_template=chat_template, metrics=metrics,
                         model_name=name, max_model_len=served.max_model_len,
                         max_in_flight=args.max_num_seqs + args.max_waiting, max_request_bytes=args.max_request_bytes,
                         max_prompt_chars=args.max_prompt_chars, allow_unknown_fields=args.allow_unknown_fields,
                         tool_call_parser=args.tool_call_parser)
    server = _uvicorn_server(build_app(ctx), args.host, args.port, args.shutdown_timeout,
                             lambda: engine_loop.stop(timeout=0))
    watching = watch_job(engine_loop.fail_all) if several else None
    try:
        server.run()
    finally:
        if compiler is not None:
            compiler.stop()       # the compile in progress ends; the queued ones are dropped
        if watching is not None:
            engine_loop.stop()
            watching.set()
            release_followers(served.engine)
    if not server.started:
        raise OSError(f"could not listen on {args.host}:{args.port} (see the message above)")
    print("scv-jax serve: stopped", file=sys.stderr, flush=True)
    return 0
