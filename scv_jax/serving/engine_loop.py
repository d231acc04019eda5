"""The engine on its own thread: request handlers submit and abort through a thread-safe queue of
commands, and each request's events come back through the callback it was submitted with (the
server's callback hands them to the asyncio loop with ``call_soon_threadsafe``).

Only this thread calls the engine. Events (an ``Event``): ``Added`` (the engine took the request),
``Refused`` (``add_request`` refused it: a 400), ``Output`` (a ``RequestOutput`` of it),
``EngineFailed`` (a step raised: every request in the engine is aborted and failed, a 500, and the
loop carries on; or ``add_request`` raised other than ValueError) and ``Shutdown`` (the loop stopped
before the request finished, or before it was added: every request submitted gets an answer).
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from scv_jax import RequestOutput

IDLE_WAIT_SECONDS = 0.05     # how long an idle loop waits for a command before checking for shutdown


@dataclasses.dataclass(frozen=True)
class Added:
    """The engine took the request."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """``add_request`` refused the request (ValueError): ``message`` says why."""

    message: str


@dataclasses.dataclass(frozen=True)
class Output:
    """Tokens of the request, or its end (``output.finished``)."""

    output: RequestOutput


@dataclasses.dataclass(frozen=True)
class EngineFailed:
    """The engine raised: the request is aborted and ends with ``message``."""

    message: str


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """The loop stopped before the request finished."""


Event = Added | Refused | Output | EngineFailed | Shutdown
Post = Callable[[Event], None]


@dataclasses.dataclass(frozen=True)
class _Add:
    """Adds a request; its events go to ``post``."""

    request_id: str
    prompt: list[int]
    params: Any
    post: Post


@dataclasses.dataclass(frozen=True)
class _Abort:
    """Aborts a request (its handler ended it: no more events)."""

    request_id: str


_Command = _Add | _Abort


class EngineLoop:
    """Drives ``engine`` (``scv_jax.Engine``'s interface) from one thread; ``on_queue(engine)`` is called
    on that thread after every step and command batch (the metrics' gauges read the engine there)."""

    def __init__(self, engine: Any, on_queue: Callable[[Any], None] = lambda engine: None):
        self._engine, self._on_queue = engine, on_queue
        self._commands: queue.Queue = queue.Queue()
        self._posts: dict[str, Post] = {}        # this thread's: the unfinished requests' callbacks
        self._stopping = threading.Event()
        self._lock = threading.Lock()             # orders submit against the loop's end
        self._closed = False                      # the loop ended: submit answers Shutdown itself
        self._thread = threading.Thread(target=self._run, name="scv-jax-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: Any, post: Post) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(_Add(request_id, list(prompt_token_ids), params, post))
                return
        post(Shutdown())

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Ends the thread after its current step, waiting up to ``timeout`` (0: not waiting); what is
        unfinished is aborted and its requests get ``Shutdown``."""
        self._stopping.set()
        if timeout != 0 and self._thread.ident is not None:
            self._thread.join(timeout)

    def fail_all(self, message: str) -> None:
        """From another thread, when the engine's thread may never return (a step waiting on a process
        that stopped): ends every request submitted with ``EngineFailed(message)`` and the loop (the
        engine is not called again)."""
        with self._lock:
            self._closed = True
        self._stopping.set()
        for command in self._take(block=False):
            if isinstance(command, _Add):
                command.post(EngineFailed(message))
        for post in list(self._posts.values()):
            post(EngineFailed(message))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply(self._take(block=not self._engine.has_unfinished()))
            if self._engine.has_unfinished():
                self._step()
            self._on_queue(self._engine)
        with self._lock:
            self._closed = True
        for command in self._take(block=False):
            if isinstance(command, _Add):
                command.post(Shutdown())
        self._abort_all(Shutdown())

    def _take(self, *, block: bool) -> list[_Command]:
        commands = []
        try:
            if block:
                commands.append(self._commands.get(timeout=IDLE_WAIT_SECONDS))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, commands: list[_Command]) -> None:
        for command in commands:
            match command:
                case _Add(request_id, prompt, params, post):
                    try:
                        self._engine.add_request(prompt, params, request_id=request_id)
                    except ValueError as e:
                        post(Refused(str(e)))
                        continue
                    except Exception as e:     # noqa: BLE001 (a bug refusing one request must not end the loop)
                        traceback.print_exc(file=sys.stderr)
                        post(EngineFailed(f"add_request failed: {type(e).__name__}: {e}"))
                        continue
                    self._posts[request_id] = post
                    post(Added())
                case _Abort(request_id):
                    if self._posts.pop(request_id, None) is not None:
                        self._engine.abort(request_id)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as e:     # noqa: BLE001 (the server survives a failed step)
            traceback.print_exc(file=sys.stderr)
            self._abort_all(EngineFailed(f"the engine step failed: {type(e).__name__}: {e}"))
            return
        for output in outputs:
            post = self._posts.get(output.request_id)
            if post is None:       # aborted by its handler meanwhile
                continue
            if output.finished:
                del self._posts[output.request_id]
            post(Output(output))

    def _abort_all(self, event: Event) -> None:
        for request_id, post in list(self._posts.items()):
            try:
                self._engine.abort(request_id)
            except Exception:      # noqa: BLE001 (an engine that just failed may fail again; the request ends anyway)
                traceback.print_exc(file=sys.stderr)
            post(event)
        self._posts.clear()
