"""The processes of a multi-controller job (``jax.distributed.initialize``): process 0 leads, the others
follow. What the leader decides reaches the followers through JAX's coordination service (the key-value
store that ``jax.distributed.initialize`` starts in process 0): one small message per engine step
(``StepChannel``), never through the devices, so it never waits behind a step in flight. ``watch``
notices a process that stopped (its heartbeats: ``heartbeat_timeout_seconds`` of ``initialize``) and
``agree`` checks at start that every process was given the same settings.

The channel's keys live under one namespace per engine (``StepChannel.open`` counts them: every process
must create its leader-driven engines in the same order, as the same program does).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from typing import Callable

import jax

POLL_SECONDS = 1.0              # how often a waiting follower and ``watch`` check that every process lives
ACK_EVERY = 32                  # a follower reports the messages it applied every this many
START_SECONDS = 3600            # how long the first message waits for every process to reach it (warm-ups)
LEADER = 0

_engines = itertools.count()    # the namespace of the next channel (the same order in every process)
_meetings = itertools.count()   # the barrier of the next ``wait_for_all`` (the same order in every process)


class ProcessFailure(RuntimeError):
    """A process of the job stopped (or the coordination service is gone)."""


def _client():
    """JAX's coordination-service client (the one ``jax.distributed.initialize`` connected)."""
    from jax._src import distributed     # jax has no public accessor for the job's key-value store

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several processes need jax.distributed.initialize(...) first")
    return client


def spans_processes(mesh) -> bool:
    """Whether ``mesh`` holds devices of more than one process."""
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def lower_alike() -> None:
    """Makes every process compile a program to the same executable. JAX writes Python call stacks into the
    program's source locations, and they differ with each process's history (a function's lowering JAX
    cached during other work, e.g. a one-device run on process 0 only); XLA keys the collectives of a run
    by its executable, so the processes' executables, different only in those locations, waited for each
    other forever (two CPU processes, gloo). Locations keep their innermost frame, its file without
    its folder (a user's own ``jax_hlo_source_file_canonicalization_regex`` stays)."""
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    if jax.config.jax_hlo_source_file_canonicalization_regex is None:
        jax.config.update("jax_hlo_source_file_canonicalization_regex", ".*/")


def is_leader() -> bool:
    return jax.process_index() == LEADER


def dead_processes() -> list[int]:
    """The processes of the job that stopped sending heartbeats (raises ``ProcessFailure`` when the
    coordination service itself is gone: the leader stopped)."""
    everyone = list(range(jax.process_count()))
    try:
        live = _client().get_live_nodes(everyone)
    except Exception as error:                  # noqa: BLE001 (the service's RPC errors have no public type)
        raise ProcessFailure(f"the coordination service (process {LEADER}) is unreachable: {error}") from None
    return [p for p in everyone if p not in live]


def check_alive() -> None:
    """Raises ``ProcessFailure`` when a process of the job stopped."""
    dead = dead_processes()
    if dead:
        raise ProcessFailure(f"process(es) {dead} of the job stopped (no heartbeat)")


def watch(on_failure: Callable[[str], None], interval: float = POLL_SECONDS) -> threading.Event:
    """Starts a daemon thread that calls ``on_failure(message)`` once, when a process of the job stops,
    unless the returned event is set first."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            try:
                check_alive()
            except ProcessFailure as error:
                if not stop.is_set():
                    on_failure(str(error))
                return

    threading.Thread(target=run, name="scv-jax-process-watch", daemon=True).start()
    return stop


def wait_for_others_to_leave(timeout: float) -> bool:
    """Waits up to ``timeout`` seconds for every other process to end its part in the job
    (``jax.distributed.shutdown``, or stopping); whether all did. The leader calls it before it exits:
    the coordination service lives in its process, and a follower shutting down needs it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(dead_processes()) == jax.process_count() - 1:
            return True
        time.sleep(0.1)
    return False


def agree(settings: dict[str, str], timeout: float = 300.0) -> None:
    """Raises ValueError, naming the first setting that differs, unless every process passed the same
    ``settings`` ({name: value as text}, e.g. its command's flags); every process calls it once."""
    client, me = _client(), jax.process_index()
    client.key_value_set(f"scv_jax/settings/{me}", json.dumps(settings, sort_keys=True))
    for other in range(jax.process_count()):
        if other == me:
            continue
        theirs = json.loads(client.blocking_key_value_get(f"scv_jax/settings/{other}", int(timeout * 1000)))
        for name in sorted(set(settings) | set(theirs)):
            if settings.get(name) != theirs.get(name):
                raise ValueError(f"{name}: process {me} has {settings.get(name)}, process {other} has "
                                 f"{theirs.get(name)}; every process of the job must be started with the same "
                                 "settings")


def wait_for_all() -> None:
    """Waits until every process of the job reached its own call (the n-th call of each process meets the
    n-th of the others: call it in the same order in every process; ``START_SECONDS`` at most). Gloo gives
    up on a collective's first use (its connections) when one process comes more than 30 s after the
    other, e.g. from a longer warm-up or other work before."""
    _client().wait_at_barrier(f"scv_jax/meeting{next(_meetings)}", int(START_SECONDS * 1000))


class StepChannel:
    """Messages (bytes) from the leader to every follower, in order: ``publish`` on the leader, ``receive``
    on a follower. Each costs one key-value operation on the coordination service (process 0's); the
    leader deletes what every follower reported applied."""

    def __init__(self, namespace: str):
        self._client, self._prefix = _client(), namespace
        self._sent = 0              # leader: messages published
        self._kept_from = 0         # leader: the oldest message not deleted
        self._received = 0          # follower: messages received
        self.closed = False         # leader: the last message (the engine's close) was published
        self._started = False       # every process reached the first message

    @classmethod
    def open(cls) -> StepChannel:
        """The next engine's channel (call it in the same order in every process)."""
        return cls(f"scv_jax/engine{next(_engines)}")

    def _start(self) -> None:
        """Waits for every process at the first message: gloo gives up on a collective's first use (its
        connections) when one process comes more than 30 s after the other, e.g. from a longer warm-up."""
        self._client.wait_at_barrier(f"{self._prefix}/start", int(START_SECONDS * 1000))
        self._started = True

    def publish(self, message: bytes) -> None:
        if not self._started:
            self._start()
        self._client.key_value_set_bytes(f"{self._prefix}/{self._sent}", message)
        self._sent += 1
        if self._sent % ACK_EVERY == 0:
            self._forget_applied()

    def _forget_applied(self) -> None:
        """Deletes the messages every follower reported applied."""
        applied = self._sent
        for follower in range(jax.process_count()):
            if follower != LEADER:
                try:
                    applied = min(applied, int(self._client.key_value_try_get(f"{self._prefix}/ack/{follower}")))
                except Exception:   # noqa: BLE001 (no report yet: NOT_FOUND)
                    return
        for index in range(self._kept_from, applied):
            self._client.key_value_delete(f"{self._prefix}/{index}")
        self._kept_from = max(self._kept_from, applied)

    def receive(self) -> bytes:
        """The next message; raises ``ProcessFailure`` when a process stopped meanwhile."""
        if not self._started:
            self._start()
        key = f"{self._prefix}/{self._received}"
        while True:
            try:
                message = self._client.blocking_key_value_get_bytes(key, int(POLL_SECONDS * 1000))
                break
            except Exception:       # noqa: BLE001 (a deadline: nothing yet; a stopped process shows below)
                check_alive()
        self._received += 1
        if self._received % ACK_EVERY == 0:
            self._client.key_value_set(f"{self._prefix}/ack/{jax.process_index()}", str(self._received),
                                       allow_overwrite=True)
        return message


def fail_fast(message: str) -> None:
    """Ends this process at once with status 1 after one line on stderr (a watch's answer where nothing
    is left to do cleanly: a step waiting on a stopped process never returns)."""
    print(f"scv-jax: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(1)
