"""Fixtures of the server tests: the tiny checkpoint (written once per session) and an OpenAI client
factory (127.0.0.1 only, every call with a timeout and no retries)."""

from __future__ import annotations

import pathlib

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
