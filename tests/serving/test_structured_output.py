"""Structured output through ``scv-jax serve`` with the ``openai`` client (n-gram drafting, the tiny
byte-level checkpoint): OpenAI's ``response_format`` (``json_schema``, ``json_object``) and vLLM's
``guided_choice`` / ``guided_regex`` / ``structured_outputs`` constrain completions and chats, streamed
and not, sampled and greedy (every output parses and validates); a bad constraint, two at once or an
unsupported backend are a 400 naming the field."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.serving.conftest import client, post_error
from tests.serving.harness import ServerProcess

NAME = "tiny"
COMMON = ["--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "192", "--max-num-seqs", "4",
          "--no-warmup"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process = ServerProcess(["--model", str(checkpoint), *COMMON, "--ngram", "--k", "3"],
                            tmp_path_factory.mktemp("logs") / "structured.log")
    yield process
    assert process.stop(signal.SIGTERM) == 0, process.stderr()


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "size"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and isinstance(value["size"], int) and 0 <= value["size"] <= 99)


@pytest.mark.slow
def test_json_schema_chat_and_completion_validate(server):
    api = client(server.url)
    schema_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    chat = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a thing"}],
                                       response_format=schema_format, max_tokens=60, temperature=0)
    assert chat.choices[0].finish_reason == "stop" and _valid(chat.choices[0].message.content), chat
    for seed in range(3):           # sampled: each a valid object
        out = api.completions.create(model=NAME, prompt="def f(", max_tokens=60, temperature=1.0, seed=seed,
                                     extra_body={"response_format": schema_format})
        assert out.choices[0].finish_reason == "stop" and _valid(out.choices[0].text), out.choices[0].text


def test_json_object_streamed_is_one_object(server):
    api = client(server.url)
    stream = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "json please"}],
                                         response_format={"type": "json_object"}, max_tokens=80, stream=True,
                                         temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if reasons == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:                           # cut at max_tokens: still a prefix of an object
        assert reasons == ["length"] and text.startswith("{")


def test_vllm_guided_fields(server):
    api = client(server.url)
    choice = api.completions.create(model=NAME, prompt="x = ", max_tokens=10, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
    assert choice.choices[0].text in ("alpha", "beta", "gamma delta")
    regex = api.completions.create(model=NAME, prompt="n = ", max_tokens=12, temperature=0,
                                   extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    nested = api.completions.create(model=NAME, prompt="y = ", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert nested.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " *", "guided_json": {}}, "guided_whitespace_pattern")])
def test_bad_constraints_are_400_naming_the_field(server, body, field):
    error = post_error(server.url, "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 4, **body}, 400)
    assert error["param"] == field, error
