"""Starting ``scv-jax serve`` as a subprocess on a free port of 127.0.0.1 and stopping it, every wait
bounded."""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT = 240      # loading + warm-up on 2 shared CPU cores
STOP_TIMEOUT = 60


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server: ``url`` (http://127.0.0.1:PORT), ``stderr()`` (its log), ``stop(sig)`` -> exit status."""

    def __init__(self, serve_argv: list[str], log: pathlib.Path, *, fake: bool = False, fault_on: str = "",
                 env: dict[str, str] | None = None):
        launcher = [sys.executable, "-m", "tests.serving.launch", *(["--fake"] if fake else []),
                    *(["--fault-on", fault_on] if fault_on else []), "--"]
        self.log = log
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})}
        self._stderr = open(log, "w")
        self.process = subprocess.Popen([*launcher, "serve", "--host", "127.0.0.1", "--port", "0", *serve_argv],
                                        cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=self._stderr,
                                        text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for_address()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("scv-jax serve: listening on "):
                return line.split()[-1]
        self.process.kill()
        self.process.wait(STOP_TIMEOUT)
        raise RuntimeError(f"the server did not start (status {self.process.returncode}):\n{self.stderr()}")

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Sends ``sig`` and waits for the exit (killed after STOP_TIMEOUT); its status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait()

    def wait(self) -> int:
        """Waits for the exit of a server already signalled (killed after STOP_TIMEOUT); its status. (A
        second signal could land after uvicorn's shutdown restored the default handlers: status -15.)"""
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT)
        self._stderr.close()
        return self.process.returncode
