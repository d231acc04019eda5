"""``scv-jax serve`` as one JAX multi-controller job over several processes (hosts): every process runs the
same command; ``--num-processes`` / ``--process-id`` / ``--coordinator-address`` (or ``JAX_NUM_PROCESSES``
/ ``JAX_PROCESS_ID`` / ``JAX_COORDINATOR_ADDRESS``; ``--num-processes auto``: SLURM, Open MPI or
Kubernetes, as ``jax.distributed.initialize`` detects them) join it. Process 0 serves HTTP and drives the
engine; the others follow it (``Engine.follow``). Every process checks at start that all were given the
same flags, and watches that all still run: a process that stops ends the others (the leader fails its
requests first) within ``--heartbeat-timeout`` seconds and a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Callable

# flags that differ between the processes of one job (the others must agree)
PER_PROCESS_FLAGS = ("process_id", "coordinator_address", "command_line", "host", "port")
FAILED_EXIT_GRACE_SECONDS = 1.0     # a failed job's leader lets its error events reach the clients, then exits
LEAVE_SECONDS = 60.0                # how long a leader that ends waits for its followers to leave the job


def _from_env(value, name: str):
    return value if value is not None else os.environ.get(name)


def join(args: argparse.Namespace) -> bool:
    """Joins the job the flags (or the environment) name before JAX starts; True when it has several
    processes. Raises ValueError naming the flag for a mistake."""
    count = _from_env(args.num_processes, "JAX_NUM_PROCESSES")
    if count is None or count in ("1", 1):
        return False
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")    # CPU devices' collectives across processes
    jax.config.update("jax_enable_recoverability", True)     # a stopped process is reported (watch), not fatal
    timeout = dict(heartbeat_timeout_seconds=args.heartbeat_timeout)
    if count == "auto":
        jax.distributed.initialize(**timeout)
        return jax.process_count() > 1
    if not str(count).isdigit() or int(count) < 1:
        raise ValueError(f"--num-processes must be an int >= 1 or auto, got {count!r}")
    address = _from_env(args.coordinator_address, "JAX_COORDINATOR_ADDRESS")
    process_id = _from_env(args.process_id, "JAX_PROCESS_ID")
    if address is None or process_id is None:
        raise ValueError(f"--num-processes {count} needs --coordinator-address HOST:PORT and --process-id I (or "
                         "JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID)")
    if not str(process_id).isdigit() or not 0 <= int(process_id) < int(count):
        raise ValueError(f"--process-id must be an int in [0, --num-processes={count}), got {process_id!r}")
    jax.distributed.initialize(address, int(count), int(process_id), **timeout)
    return True


def check_same_flags(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first flag another process of the job was given differently."""
    import jax

    from scv_jax.sharding.processes import agree, is_leader, wait_for_others_to_leave

    settings = {"--" + name.replace("_", "-"): repr(value) for name, value in sorted(vars(args).items())
                if name not in PER_PROCESS_FLAGS and not callable(value)}
    try:
        agree(settings)
    except ValueError:      # the job ends: the followers leave it first (process 0 holds its coordination service)
        if is_leader():
            wait_for_others_to_leave(LEAVE_SECONDS)
        else:
            jax.distributed.shutdown()
        raise


def check_mesh(mesh_shape: tuple[int, int] | None) -> None:
    """Raises ValueError unless ``--mesh`` spans every device of the job."""
    import jax

    count = jax.device_count()
    if mesh_shape is None or mesh_shape[0] * mesh_shape[1] != count:
        got = "none" if mesh_shape is None else f"{mesh_shape[0]},{mesh_shape[1]}"
        raise ValueError(f"--mesh: over {jax.process_count()} processes the mesh must span all {count} devices of "
                         f"the job (DATA x MODEL = {count}, e.g. {jax.process_count()},{count // jax.process_count()}), "
                         f"got {got}")


def watch_job(fail_requests: Callable[[str], None]) -> threading.Event:
    """Watches the job from the leader: when a process stops, ``fail_requests(message)`` ends every request
    (their clients get an error), then the process exits with status 1. Set the returned event before the
    followers are let go."""
    from scv_jax.sharding.processes import fail_fast, watch

    def on_failure(message: str) -> None:
        fail_requests(f"the serving job failed: {message}")
        time.sleep(FAILED_EXIT_GRACE_SECONDS)
        fail_fast(message)

    return watch(on_failure)


def release_followers(engine) -> None:
    """Ends the followers (``engine.close()``) and waits up to ``LEAVE_SECONDS`` for them to leave the job."""
    from scv_jax.sharding.processes import wait_for_others_to_leave

    engine.close()
    if not wait_for_others_to_leave(LEAVE_SECONDS):
        print(f"scv-jax serve: the followers did not leave the job within {LEAVE_SECONDS:.0f} s", file=sys.stderr,
              flush=True)


def follow(engine) -> int:
    """Runs a follower: ``engine.follow()`` until the leader closes it (0) or a process stops (1). SIGINT and
    SIGTERM do not end a follower: it ends with the leader, which drains its requests first."""
    import jax

    from scv_jax.sharding.processes import ProcessFailure

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: print("scv-jax serve: a follower ends when process 0 does", file=sys.stderr,
                                            flush=True))
    print(f"scv-jax serve: process {jax.process_index()} follows process 0", file=sys.stderr, flush=True)
    try:
        engine.follow()
    except ProcessFailure as error:
        print(f"scv-jax serve: {error}", file=sys.stderr, flush=True)
        return 1
    jax.distributed.shutdown()      # leaves the job while the leader (its coordination service) waits for it
    print("scv-jax serve: stopped", file=sys.stderr, flush=True)
    return 0
