"""Replicas behind a router (docs/serving.md, "Replicas behind a router"): two ``scv-jax serve`` replicas
(on the fake engine: the routing is under test, not the decoding) behind vLLM's router (``vllm-router``,
prefix-aware ``cache_aware`` policy, health checks on ``/health``), used by the ``openai`` client on
127.0.0.1: answers and errors pass through unchanged, a repeated prompt stays on one replica, and a replica
taken out of the router (``/remove_worker``) and stopped with SIGTERM leaves it answering from the other."""

from __future__ import annotations

import pathlib
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from tests.serving.conftest import client, metrics, post_error, wait_for
from tests.serving.harness import STOP_TIMEOUT, ServerProcess, free_port

NAME = "tiny"
ROUTER = shutil.which("vllm-router") or str(pathlib.Path(sys.executable).with_name("vllm-router"))


def _served(url: str) -> float:
    """Requests a replica has answered (``vllm:request_success_total``, every finish reason)."""
    return sum(value for (name, _), value in metrics(url).items() if name == "vllm:request_success_total")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_replicas_behind_vllm_router(checkpoint, tmp_path):
    replicas = [ServerProcess(["--model", str(checkpoint), "--served-model-name", NAME], tmp_path / f"replica{i}.log",
                              fake=True) for i in range(2)]
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                               "--worker-urls", *(r.url for r in replicas), "--health-check-endpoint", "/health",
                               "--health-check-interval-secs", "1", "--prometheus-port", str(free_port()),
                               "--prometheus-host", "127.0.0.1"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _healthy(url)), (tmp_path / "router.log").read_text()[-3000:]
        via, direct = client(url), client(replicas[0].url)
        kwargs = dict(model=NAME, prompt="def main(", max_tokens=12, temperature=0)
        assert [m.id for m in via.models.list().data] == [NAME]
        # answers pass through unchanged: plain, streamed and chat (the router adds SGLang's fields at their
        # defaults to every request; scv-jax accepts them at those values)
        text = direct.completions.create(**kwargs).choices[0].text
        assert via.completions.create(**kwargs).choices[0].text == text
        assert "".join(c.choices[0].text for c in via.completions.create(stream=True, **kwargs)) == text
        chat = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert (via.chat.completions.create(**chat).choices[0].message.content
                == direct.chat.completions.create(**chat).choices[0].message.content)
        # a client's mistake is the replica's 4xx in OpenAI's error JSON, naming the field
        assert post_error(url, "/v1/completions", {**kwargs, "bogus": 1}, 400)["param"] == "bogus"
        assert post_error(url, "/v1/completions", {**kwargs, "echo": True}, 400)["param"] == "echo"
        # a repeated prompt stays on one replica (cache_aware: on the one holding its prefix)
        counts = [_served(r.url) for r in replicas]
        for _ in range(3):
            via.completions.create(**{**kwargs, "prompt": "class Repeated:\n    def __init__(self, name"})
        assert sorted(_served(r.url) - c for r, c in zip(replicas, counts)) == [0, 3]
        # a replica taken out of the router, then drained (SIGTERM): every request is answered by the other
        removed = httpx.post(f"{url}/remove_worker", params={"url": replicas[0].url}, timeout=10)
        assert removed.status_code < 300, removed.text
        assert replicas[0].stop(signal.SIGTERM) == 0, replicas[0].stderr()
        before = _served(replicas[1].url)
        for i in range(4):
            assert via.completions.create(**{**kwargs, "prompt": f"after {i}"}).choices[0].finish_reason == "length"
        assert _served(replicas[1].url) - before == 4
    finally:
        router.kill()
        router.wait(STOP_TIMEOUT)
        log.close()
        for replica in replicas:
            replica.stop(signal.SIGKILL)

