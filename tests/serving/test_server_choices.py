"""``n > 1`` choices and predicted outputs on the real ``Engine`` (the tiny byte-level checkpoint, n-gram
drafts), with the ``openai`` client: seeded choices repeat (choice i is the request seeded with seed + i)
and differ from each other, greedy ones are identical, streamed chunks carry their choice's index, usage
counts the prompt once, the siblings read the prompt's blocks from the prefix cache, a disconnect aborts
every choice; a prediction leaves the greedy text unchanged and reports its accepted and rejected
tokens; bad ``n``, ``best_of``, ``seed`` and ``prediction`` are 400s naming them."""

from __future__ import annotations

import json
import signal
import string

import httpx
import openai
import pytest

from scv_jax.serving.protocol import ChatRequest, engine_refusal
from tests.serving.conftest import REQUEST_TIMEOUT, client, metrics, post_error, wait_for
from tests.serving.harness import ServerProcess
from tests.serving.test_server_engine import COMMON, NAME, offline  # noqa: F401 (a fixture)

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "def main("}]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process = ServerProcess(["--model", str(checkpoint), *COMMON, "--ngram", "--k", "4", "--max-prompt-chars", "512"],
                            tmp_path_factory.mktemp("logs") / "choices.log")
    yield process
    assert process.stop(signal.SIGTERM) == 0, process.stderr()


def _texts(response) -> list[str]:
    assert [c.index for c in response.choices] == list(range(len(response.choices)))
    return [c.text if hasattr(c, "text") else c.message.content for c in response.choices]


@pytest.mark.slow
def test_seeded_choices_repeat_and_differ(server):
    c = client(server.url)
    ask = lambda n, seed: c.completions.create(model=NAME, prompt="import ", max_tokens=12, temperature=1.0,  # noqa: E731
                                               seed=seed, n=n)
    first, again = ask(3, 5), ask(3, 5)
    assert _texts(first) == _texts(again)
    assert len(set(_texts(first))) > 1                          # independent streams
    assert _texts(first)[1] == _texts(ask(1, 6))[0]              # choice i is seeded with seed + i (vLLM)
    assert first.usage.prompt_tokens == 7
    assert first.usage.completion_tokens == sum(len(t.encode()) for t in _texts(first)) == 36
    unseeded = c.completions.create(model=NAME, prompt="import ", max_tokens=12, temperature=1.0, n=3)
    assert len(set(_texts(unseeded))) > 1


def test_greedy_choices_are_identical(server, offline, tokenizer):
    c = client(server.url)
    expected = tokenizer.decode(offline(tokenizer.encode("class Foo:"), 10))
    out = c.completions.create(model=NAME, prompt="class Foo:", max_tokens=10, temperature=0, n=3, best_of=3)
    assert _texts(out) == [expected] * 3 and [ch.finish_reason for ch in out.choices] == ["length"] * 3


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_choices_carry_their_index(server, include_usage):
    c = client(server.url)
    whole = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=2, n=3)
    stream = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=2, n=3,
                                       stream=True, stream_options={"include_usage": include_usage})
    texts, roles, finish, usage = ["", "", ""], [0, 0, 0], [None] * 3, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert finish[choice.index] is None          # nothing after a choice's finish reason
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            finish[choice.index] = choice.finish_reason
    assert texts == _texts(whole) and roles == [1, 1, 1] and finish == [c.finish_reason for c in whole.choices]
    if include_usage:
        assert usage.model_dump(exclude_none=True) == whole.usage.model_dump(exclude_none=True)
        assert usage.completion_tokens == sum(len(t.encode()) for t in texts)


def test_the_siblings_read_the_prompt_from_the_prefix_cache(server):
    """A fresh prompt of 3 full blocks of 16 tokens: the first choice computes it, the two others find it
    cached (the prefix-cache hit counter grows by their 2 x 48 tokens)."""
    prompt = "# n = 3 shares this prompt's blocks: " + string.ascii_letters[:20]
    before = metrics(server.url)
    out = client(server.url).completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, n=3)
    cached = (len(prompt.encode()) - 1) // 16 * 16
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and cached == 48
    hits = ("vllm:prefix_cache_hits_total", ())
    assert wait_for(lambda: metrics(server.url)[hits] - before[hits] == 2 * cached), metrics(server.url)[hits]


def test_a_disconnect_aborts_every_choice(server):
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    before = metrics(server.url).get(key, 0)
    with httpx.Client(timeout=REQUEST_TIMEOUT) as http:
        with http.stream("POST", f"{server.url}/v1/completions",
                         json={"model": NAME, "prompt": "long", "max_tokens": 150, "stream": True, "n": 3,
                               "temperature": 1.0, "ignore_eos": True}) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(10)]       # a few chunks arrive, then the client goes away
    assert wait_for(lambda: metrics(server.url).get(key, 0) == before + 3)
    assert wait_for(lambda: metrics(server.url)[("vllm:num_requests_running", ())] == 0)
    assert metrics(server.url)[("vllm:kv_cache_usage_perc", ())] == 0


def test_a_prediction_changes_the_speed_not_the_text(server):
    c = client(server.url)
    plain = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None            # no prediction, no details
    exact = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                                      prediction={"type": "content", "content": text})
    details = exact.usage.completion_tokens_details
    assert exact.choices[0].message.content == text
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    assert exact.model_extra["spec_decode"]["num_accepted_tokens"] >= details.accepted_prediction_tokens
    parts = [{"type": "text", "text": "zq" * 10}, {"type": "text", "text": text[5:]}]
    wrong = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0, n=2,
                                      prediction={"type": "content", "content": parts})
    assert _texts(wrong) == [text] * 2
    details = wrong.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0 and details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("fields,param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2.0}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
    ({"n": 2, "seed": 2 ** 63 - 1}, "seed"),
    ({"prediction": "text"}, "prediction"), ({"prediction": {"type": "text", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content"}}, "prediction"), ({"prediction": {"type": "content", "content": 5}}, "prediction"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": "u"}]}}, "prediction"),
    ({"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction"),
    ({"prediction": {"type": "content", "content": "x" * 600}}, "prediction"),
])
def test_bad_n_and_prediction_are_400s_naming_them(server, fields, param):
    error = post_error(server.url, CHAT, {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **fields}, 400)
    assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError, match=param):
        client(server.url).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, extra_body=fields)


def test_an_engine_without_a_host_drafter_refuses_a_prediction_naming_it():
    """The engine's refusal (a draft model, an EAGLE head or no drafter) is a 400 naming ``prediction``."""
    request = ChatRequest.model_validate_json(json.dumps({"messages": MESSAGES, "prediction": {
        "type": "content", "content": "x"}}))
    error = engine_refusal(request, "add_request: SamplingParams.prediction needs an engine with a host drafter")
    assert (error.status, error.param) == (400, "prediction")
