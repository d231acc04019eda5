"""Fixtures of the server tests: the tiny checkpoint (written once per session), an OpenAI client
factory (127.0.0.1 only, every call with a timeout and no retries), raw error requests and bounded waits."""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Callable

import pytest

from scv_jax.demo.hf_export import write_checkpoint

REQUEST_TIMEOUT = 60.0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return write_checkpoint(tmp_path_factory.mktemp("serving") / "tiny-bytes")


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from scv_jax.models import load_tokenizer

    return load_tokenizer(checkpoint)


def client(url: str):
    import openai

    assert url.startswith("http://127.0.0.1:")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed by prometheus_client: {(sample name, sorted labels without model_name): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=REQUEST_TIMEOUT).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def post_error(url: str, path: str, body: Any, status: int, headers: dict[str, str] | None = None) -> dict:
    """POSTs ``body`` (JSON unless bytes or str) raw and checks that the answer is ``status`` with OpenAI's
    error object; that object."""
    import httpx

    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = httpx.post(f"{url}{path}", content=content,
                          headers={"content-type": "application/json"} if headers is None else headers,
                          timeout=REQUEST_TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


SPEC_FIELDS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
               "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens", "num_accepted_tokens_per_pos"}


def spec_metrics(body: dict) -> dict:
    """A response's (or a stream's last chunk's) ``metrics.speculative_decoding``, checked to be vLLM's
    shape and to add up (the histogram, the per-position counts, the ratios, the ``spec_decode`` counts)."""
    spec = body["metrics"]["speculative_decoding"]
    assert set(spec) == SPEC_FIELDS, spec
    histogram, k, steps = spec["acceptance_histogram"], spec["num_spec_tokens"], spec["num_spec_steps"]
    accepted, drafted = spec["num_accepted_draft_tokens"], spec["num_draft_tokens"]
    assert len(histogram) == k + 1 and sum(histogram) == steps and min(histogram) >= 0, spec
    assert sum(j * count for j, count in enumerate(histogram)) == accepted <= drafted <= k * steps, spec
    assert spec["num_accepted_tokens_per_pos"] == [sum(histogram[j + 1:]) for j in range(k)], spec
    assert spec["mean_acceptance_length"] == (1 + accepted / steps if steps else 1.0), spec
    assert spec["draft_acceptance_rate"] == (accepted / drafted if drafted else 0.0), spec
    if "spec_decode" in body:
        assert body["spec_decode"] == {"num_draft_tokens": drafted, "num_accepted_tokens": accepted}
    return spec
