"""The engine on its own thread: request handlers submit and abort through a thread-safe queue of
commands, and each request's events come back through the callback it was submitted with (the
server's callback hands them to the asyncio loop with ``call_soon_threadsafe``).

Only this thread calls the engine. Events: ``("added",)``, ``("error", message)`` (``add_request``
refused the request: a 400), ``("output", RequestOutput)``, ``("failed", message)`` (a step raised:
every request in the engine is aborted and failed, a 500, and the loop carries on) and
``("shutdown",)`` (the server stopped before the request finished).
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

Post = Callable[[tuple], None]
IDLE_WAIT_SECONDS = 0.05     # how long an idle loop waits for a command before checking for shutdown


class EngineLoop:
    """Drives ``engine`` (``scv_jax.Engine``'s interface) from one thread; ``on_queue(engine)`` is called
    on that thread after every step and command batch (the metrics' gauges read the engine there)."""

    def __init__(self, engine: Any, on_queue: Callable[[Any], None] = lambda engine: None):
        self._engine, self._on_queue = engine, on_queue
        self._commands: queue.Queue = queue.Queue()
        self._posts: dict[str, Post] = {}        # this thread's: the unfinished requests' callbacks
        self._thread = threading.Thread(target=self._run, name="scv-jax-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: Any, post: Post) -> None:
        self._commands.put(("add", request_id, list(prompt_token_ids), params, post))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Aborts what is unfinished (its requests get ``("shutdown",)``) and ends the thread."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            if not self._apply(self._take(block=not self._engine.has_unfinished())):
                return
            if self._engine.has_unfinished():
                self._step()
            self._on_queue(self._engine)

    def _take(self, *, block: bool) -> list[tuple]:
        commands = []
        try:
            if block:
                commands.append(self._commands.get(timeout=IDLE_WAIT_SECONDS))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, commands: list[tuple]) -> bool:
        """Runs the commands; False after a stop."""
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params, post = command
                try:
                    self._engine.add_request(prompt, params, request_id=request_id)
                except ValueError as e:
                    post(("error", str(e)))
                    continue
                except Exception as e:     # noqa: BLE001 (a bug refusing one request must not end the loop)
                    traceback.print_exc(file=sys.stderr)
                    post(("failed", f"add_request failed: {type(e).__name__}: {e}"))
                    continue
                self._posts[request_id] = post
                post(("added",))
            elif command[0] == "abort":
                if self._posts.pop(command[1], None) is not None:
                    self._engine.abort(command[1])
            else:
                self._abort_all(("shutdown",))
                return False
        return True

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as e:     # noqa: BLE001 (the server survives a failed step)
            traceback.print_exc(file=sys.stderr)
            self._abort_all(("failed", f"the engine step failed: {type(e).__name__}: {e}"))
            return
        for output in outputs:
            post = self._posts.get(output.request_id)
            if post is None:       # aborted by its handler meanwhile
                continue
            if output.finished:
                del self._posts[output.request_id]
            post(("output", output))

    def _abort_all(self, event: tuple) -> None:
        for request_id, post in list(self._posts.items()):
            try:
                self._engine.abort(request_id)
            except Exception:      # noqa: BLE001 (an engine that just failed may fail again; the request ends anyway)
                traceback.print_exc(file=sys.stderr)
            post(event)
        self._posts.clear()
