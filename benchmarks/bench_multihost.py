"""What one engine step's message costs a job of several processes (``scv-jax serve --num-processes``).

    JAX_PLATFORMS=cpu python benchmarks/bench_multihost.py [--steps 200] [--append]
    JAX_PLATFORMS=cpu python benchmarks/bench_multihost.py --dry-run          # few steps (CI)

Starts 2 processes of 1 CPU device each (``jax.distributed.initialize`` on 127.0.0.1). Process 0 publishes
the messages ``Engine.step`` sends its followers (``sharding.processes.StepChannel``: the pickled changes
since the step before) and process 1 receives them, for: a step that changes nothing (the steady state
of a decoding batch), and a step that admits 1, 64 or 256 new requests at once (512-token prompts, sampled:
the largest a step carries). It reports each message's bytes, the leader's time to publish one (on its
host path every step) and the time from the first publish to the follower holding the last message,
per message (the follower's lag). Both processes share this host's cores and the coordination service
runs in process 0, so across hosts add one network round trip to the follower's time.
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
    parser.add_argument("--dry-run", action="store_true", help="10 messages per kind")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        args.steps = 10
    return args


def _messages(new_requests: int) -> bytes:
    """The message of a step that admits ``new_requests`` requests (as ``Engine.step`` pickles it)."""
    import numpy as np

    from scv_jax import SamplingParams

    changes = [("add", list(range(PROMPT_TOKENS)), SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256),
                str(i), np.arange(2, dtype=np.int32)) for i in range(new_requests)]
    return pickle.dumps((changes, False))


def _worker(args: argparse.Namespace) -> None:
    import jax
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
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
    print(json.dumps(rows), flush=True)
    jax.distributed.shutdown()


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
    workers = [subprocess.Popen([sys.executable, __file__, "--steps", str(args.steps), "--process-id", str(i),
                                 "--coordinator", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True, env=env)
               for i in (1, 0)]
    try:
        outs = [w.communicate(timeout=600)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    if any(w.returncode for w in workers):
        print("a worker failed", file=sys.stderr)
        return 1
    follower, leader = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    lines = ["| requests added in the step | message bytes | leader: publish (µs, median) | follower: per message (µs) |",
             "|---|---|---|---|"]
    for lead, follow in zip(leader, follower):
        lines.append(f"| {lead['new_requests']} | {lead['bytes']:,} | {lead['publish_us']:.0f} | "
                     f"{follow['receive_us']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.append:
        from scv_jax.demo.report import append_markdown, results_header

        command = shlex.join(["JAX_PLATFORMS=cpu", "python", "benchmarks/bench_multihost.py", *sys.argv[1:]])
        append_markdown(RESULTS, results_header(
            "The message a step sends over several processes", command,
            f"2 processes of 1 CPU device on this host, {args.steps} messages per kind, prompts of {PROMPT_TOKENS} "
            "tokens. ") + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
