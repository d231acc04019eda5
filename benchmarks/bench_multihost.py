"""What running an engine over several processes costs (``scv-jax serve --num-processes``): one step's
message, and tokens/s of one process against two.

    JAX_PLATFORMS=cpu python benchmarks/bench_multihost.py [--steps 200] [--batch 8] [--append]
    JAX_PLATFORMS=cpu python benchmarks/bench_multihost.py --dry-run    # few steps, tiny models (CI)

Starts 2 processes of 1 CPU device each (``jax.distributed.initialize`` on 127.0.0.1). Process 0 publishes
the messages ``Engine.step`` sends its followers (``sharding.processes.StepChannel``: the pickled changes
since the step before) and process 1 receives them, for: a step that changes nothing (the steady state
of a decoding batch), and a step that admits 1, 64 or 256 new requests at once (512-token prompts, sampled:
the largest a step carries). It reports each message's bytes, the leader's time to publish one (on its
host path every step) and the time from the first publish to the follower holding the last message,
per message (the follower's lag). Both processes share this host's cores and the coordination service
runs in process 0, so across hosts add one network round trip to the follower's time.

Then the same 2 processes decode: the demo pair (greedy, k = 4) on a (2, 1) mesh, data across the
processes, an ``Engine`` that process 0 drives with ``--batch`` requests of ``--max-new-tokens`` tokens,
against one process holding both CPU devices on the same mesh (warmed up; the median of ``--rounds``
runs; the tokens compared). On shared cores the ratio is the overhead of the split (gloo collectives
between processes instead of within one, the step's message), not what two hosts would gain.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shlex
import socket
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
PROMPT_TOKENS = 512


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="messages per kind")
    parser.add_argument("--batch", type=int, default=8, help="requests decoded at once")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per configuration (median)")
    parser.add_argument("--dry-run", action="store_true", help="10 messages per kind; tiny models, 1 round")
    parser.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.batch, args.max_new_tokens, args.rounds = 10, 2, 8, 1
    return args


def _messages(new_requests: int) -> bytes:
    """The message of a step that admits ``new_requests`` requests (as ``Engine.step`` pickles it)."""
    import numpy as np

    from scv_jax import SamplingParams

    changes = [("add", list(range(PROMPT_TOKENS)), SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256),
                str(i), np.arange(2, dtype=np.int32)) for i in range(new_requests)]
    return pickle.dumps((changes, [], False))


def _decode(args: argparse.Namespace) -> dict:
    """Decodes on a (2, 1) mesh of the job's devices (process 0 driving the engine): tokens/s and ms per
    step (medians over ``--rounds`` runs after a warm-up and one untimed run) and the tokens, on process 0."""
    import jax
    from flax import nnx

    import scv_jax
    from scv_jax.models import Transformer, TransformerConfig, load_demo

    if args.dry_run:
        tiny = TransformerConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                 ffn_dim=128, tie_embeddings=False)
        target, draft = Transformer(tiny, rngs=nnx.Rngs(0)), Transformer(tiny, rngs=nnx.Rngs(1))
    else:
        target, draft = load_demo()
    vocab = target.config.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(5 + i % 4)] for i in range(args.batch)]
    config = scv_jax.DecoderConfig(k=4 if not args.dry_run else 2, max_seq_len=128, batch_buckets=(args.batch,))
    engine = scv_jax.Engine(target, draft, config=config, mesh=scv_jax.decoder_mesh(2, 1))
    engine.warmup(args.batch, config.max_seq_len, temperatures=0.0)     # (greedy requests)
    if not engine.is_leader:
        engine.follow()
        return {}
    runs = []
    for _ in range(args.rounds + 1):
        tokens, steps = [[] for _ in prompts], 0
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, scv_jax.SamplingParams(max_tokens=args.max_new_tokens), str(i))
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                tokens[int(out.request_id)] += out.new_token_ids
            steps += 1
        runs.append((time.perf_counter() - start, steps, tokens))
    engine.close()
    seconds, steps, tokens = sorted(runs[1:], key=lambda run: run[0])[len(runs[1:]) // 2]
    assert all(run[2] == tokens for run in runs), "the runs' tokens differ"
    return dict(processes=jax.process_count(), tokens_per_s=sum(map(len, tokens)) / seconds,
                ms_per_step=1e3 * seconds / steps, tokens=tokens)


def _worker(args: argparse.Namespace) -> None:
    import jax
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.one_process:
        print(json.dumps(_decode(args)), flush=True)
        return
    jax.distributed.initialize(args.coordinator, 2, args.process_id)
    from scv_jax.sharding.processes import StepChannel

    rows = []
    for new_requests in (0, 1, 64, 256):
        message = _messages(new_requests)
        channel = StepChannel.open()
        started = time.perf_counter()
        if args.process_id == 0:
            publish = []
            for _ in range(args.steps):
                t = time.perf_counter()
                channel.publish(message)
                publish.append(time.perf_counter() - t)
            rows.append(dict(new_requests=new_requests, bytes=len(message),
                             publish_us=1e6 * sorted(publish)[len(publish) // 2]))
        else:
            for _ in range(args.steps):
                assert len(pickle.loads(channel.receive())[0]) == new_requests
            rows.append(dict(new_requests=new_requests,
                             receive_us=1e6 * (time.perf_counter() - started) / args.steps))
        multihost_utils.sync_global_devices(f"kind {new_requests}")
    print(json.dumps(dict(messages=rows, decode=_decode(args))), flush=True)
    jax.distributed.shutdown()


def _run(commands: list[list[str]], env: dict[str, str]) -> list[str] | None:
    """Runs the worker processes at once; their outputs (None if one failed)."""
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for command in commands]
    try:
        outs = [w.communicate(timeout=900)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    return None if any(w.returncode for w in workers) else outs


def main() -> int:
    args = _parse()
    if args.process_id is not None:
        _worker(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    common = [sys.executable, __file__, *sys.argv[1:]]
    job = _run([[*common, "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}"] for i in (1, 0)], env)
    alone = job and _run([[*common, "--one-process", "--process-id", "0"]],
                         {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    if not alone:
        print("a worker failed", file=sys.stderr)
        return 1
    follower, leader, one = (json.loads(out.strip().splitlines()[-1]) for out in job + alone)
    lines = ["| requests added in the step | message bytes | leader: publish (µs, median) | follower: per message (µs) |",
             "|---|---|---|---|"]
    for lead, follow in zip(leader["messages"], follower["messages"]):
        lines.append(f"| {lead['new_requests']} | {lead['bytes']:,} | {lead['publish_us']:.0f} | "
                     f"{follow['receive_us']:.0f} |")
    two = leader["decode"]
    lines += ["", "| (2, 1) mesh of 2 CPU devices | tokens/s | ms per step | vs one process | same tokens |",
              "|---|---:|---:|---:|---|"]
    for name, run in (("one process", one), ("two processes (data across them)", two)):
        same = "yes" if run["tokens"] == one["tokens"] else "NO"
        lines.append(f"| {name} | {run['tokens_per_s']:.1f} | {run['ms_per_step']:.2f} | "
                     f"{run['tokens_per_s'] / one['tokens_per_s']:.2f}x | {same} |")
    table = "\n".join(lines)
    print(table)
    if args.append:
        from scv_jax.demo.report import append_markdown, results_header

        command = shlex.join(["JAX_PLATFORMS=cpu", "python", "benchmarks/bench_multihost.py", *sys.argv[1:]])
        append_markdown(RESULTS, results_header(
            "An engine over several processes: the step's message, tokens/s of one process and two", command,
            f"2 processes of 1 CPU device on this host, {args.steps} messages per kind, prompts of {PROMPT_TOKENS} "
            f"tokens; decoding: {args.batch} requests of {args.max_new_tokens} tokens, greedy, median of "
            f"{args.rounds} runs. ") + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
