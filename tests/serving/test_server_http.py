"""``scv-jax serve``'s HTTP behaviour with the real ``openai`` client, on the fake engine
(``fake_engine``: a fixed text, accepted runs of 1-4 tokens per step): response shapes, streaming
(UTF-8 characters split across tokens, stop strings across tokens and runs, ``stream_options``),
logprobs, every 400 / 404 / 413 / 429 / 500 / 503 case (malformed bodies too, with raw httpx), the
limits on bodies and prompts, disconnects, metrics, graceful exit and the end of the grace period.
The request fields are checked in test_server_fields.py, the outputs of the real engine in
test_server_engine.py."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.serving.conftest import REQUEST_TIMEOUT, client, metrics, post_error, spec_metrics, wait_for
from tests.serving.fake_engine import expected_tokens
from tests.models.hub_cache import cache_repo
from tests.serving.harness import ServerProcess

NAME = "tiny"
MAX_BYTES, MAX_CHARS = 2_000_000, 800_000
JSON = {"content-type": "application/json"}
RUNNING = ("vllm:num_requests_running", ())


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process = ServerProcess(["--model", str(checkpoint), "--served-model-name", NAME, "--max-num-seqs", "8",
                             "--max-waiting", "512", "--max-request-bytes", str(MAX_BYTES), "--max-prompt-chars",
                             str(MAX_CHARS)], tmp_path_factory.mktemp("logs") / "fake.log", fake=True,
                            fault_on="FAULT")
    yield process
    assert process.stop(signal.SIGINT) == 0, process.stderr()


def _text(tokenizer, prompt: str, n: int) -> str:
    return tokenizer.decode(expected_tokens(list(prompt.encode()), n))


def test_completion_text_usage_and_spec_counts(server, tokenizer):
    out = client(server.url).completions.create(model=NAME, prompt="hello", max_tokens=21, temperature=0)
    choice, = out.choices
    assert choice.text == _text(tokenizer, "hello", 21) and choice.finish_reason == "length"
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == NAME
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 21, 26)
    spec = out.model_extra["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


@pytest.mark.parametrize("cap", [None, 0, 1])
def test_num_speculative_tokens_and_vllms_per_request_metrics(server, tokenizer, cap):
    """``extra_body={"num_speculative_tokens": n}`` caps the request's drafts per step; every response
    carries vLLM's ``metrics.speculative_decoding``, adding up, the whole response's and a stream's last
    chunk's (with and without ``stream_options.include_usage``)."""
    c = client(server.url)
    extra = {} if cap is None else {"extra_body": {"num_speculative_tokens": cap}}
    out = c.completions.create(model=NAME, prompt="hello", max_tokens=21, temperature=0, **extra)
    assert out.choices[0].text == _text(tokenizer, "hello", 21)
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=9, **extra)
    for spec in (spec_metrics(out.model_dump()), spec_metrics(chat.model_dump())):
        assert spec["num_spec_tokens"] == (3 if cap is None else cap)          # the fake's DRAFTS: 3
        assert spec["num_spec_steps"] > 0 if cap != 0 else spec["num_draft_tokens"] == spec["num_spec_steps"] == 0
        if cap == 1:
            assert spec["num_draft_tokens"] == spec["num_spec_steps"]
    for include_usage in (False, True):
        body = {"model": NAME, "prompt": "hello", "max_tokens": 13, "stream": True,
                **({} if cap is None else {"num_speculative_tokens": cap}),
                **({"stream_options": {"include_usage": True}} if include_usage else {})}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
            events = [line[len("data: "):] for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]"
        *chunks, last = [json.loads(event) for event in events[:-1]]
        assert all("metrics" not in chunk for chunk in chunks) and (last["choices"] == []) == include_usage
        spec = spec_metrics(last)
        finish = chunks[-1] if include_usage else last             # the chunk with the finish reason
        assert finish["spec_decode"]["num_draft_tokens"] == spec["num_draft_tokens"]
        assert (spec["num_draft_tokens"] == 0) == (cap == 0)


def test_token_id_prompts_and_a_one_prompt_list(server, tokenizer):
    ids = list("hey".encode())
    c = client(server.url)
    by_ids = c.completions.create(model=NAME, prompt=ids, max_tokens=9, temperature=0)
    by_list = c.completions.create(model=NAME, prompt=["hey"], max_tokens=9, temperature=0)
    assert by_ids.choices[0].text == by_list.choices[0].text == _text(tokenizer, "hey", 9)


@pytest.mark.parametrize("prompt", ["a", "bc", "def", "ghij"])
def test_stream_never_splits_a_character(server, tokenizer, prompt):
    """The fake's text has 2-, 3- and 4-byte characters, one byte per token: no chunk carries a broken
    one (but the end of an output cut by max_tokens), and the chunks add up to the decoded tokens."""
    *chunks, last = client(server.url).completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                                          stream=True, stream_options={"include_usage": True})
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == _text(tokenizer, prompt, 40) and "\ufffd" not in "".join(texts).rstrip("\ufffd")
    assert len([t for t in texts if t]) > 3                      # it did stream
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert last.choices == [] and last.usage.completion_tokens == 40


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["wörld", ["zzz", "€ 𝄞"], "o w"])
def test_stop_strings_across_tokens(server, tokenizer, stop, stream):
    full = _text(tokenizer, "hello", 60)
    stops = [stop] if isinstance(stop, str) else stop
    cut = min(i for i in (full.find(s) for s in stops) if i >= 0)
    kwargs = dict(model=NAME, prompt="hello", max_tokens=60, temperature=0, stop=stop)
    if stream:
        *chunks, last = client(server.url).completions.create(**kwargs, stream=True,
                                                              stream_options={"include_usage": True})
        text, reason, usage = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason, \
            last.usage
    else:
        out = client(server.url).completions.create(**kwargs)
        text, reason, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert text == full[:cut] and reason == "stop"
    end = next(s for s in stops if full.find(s) == cut)
    tokens = expected_tokens(list(b"hello"), 60)
    assert usage.completion_tokens == next(n for n in range(61) if end in tokenizer.decode(tokens[:n]))


def test_stop_token_ids_end_without_their_text(server, tokenizer):
    tokens = expected_tokens(list(b"hello"), 30)
    stop = tokens[7]
    first = tokens.index(stop)
    out = client(server.url).completions.create(model=NAME, prompt="hello", max_tokens=30, temperature=0,
                                                extra_body={"stop_token_ids": [stop]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first + 1
    assert out.choices[0].text == tokenizer.decode(tokens[:first])


@pytest.mark.parametrize("stream", [False, True])
def test_chat(server, tokenizer, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = "### system\nbe brief\n### user\nhi\n### assistant\n"
    c = client(server.url)
    if stream:
        *chunks, last = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert last.object == "chat.completion.chunk" and last.choices == []
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        reason, usage = chunks[-1].choices[0].finish_reason, last.usage
    else:
        out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
        assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
        text, reason, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    assert text == _text(tokenizer, prompt, 12) and reason == "length"
    assert usage.prompt_tokens == len(prompt.encode()) and usage.completion_tokens == 12


def test_logprobs(server):
    c = client(server.url)
    out = c.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) == 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)


def test_models_and_health(server):
    models = client(server.url).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(f"{server.url}/health", timeout=REQUEST_TIMEOUT).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2),
    ("max_tokens", 0), ("max_tokens", 10_000), ("n", 0), ("n", 17), ("n", "2"),
    ("seed", -1), ("seed", 2 ** 63), ("stop", 5), ("logprobs", 21),
    ("stop_token_ids", [-1]), ("stop_token_ids", [256]), ("ignore_eos", "yes"), ("stream", 1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", "high"), ("repetition_penalty", 0), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("min_tokens", 5), ("allowed_token_ids", []), ("bad_words", ["extraordinarily"]), ("bad_words", "e"),
    ("prompt", [999]), ("prompt", ""), ("prompt", "x" * 600), ("prompt", ["a", "b"]), ("prompt", None),
    ("num_speculative_tokens", -1), ("num_speculative_tokens", "2"), ("num_speculative_tokens", 1.5),
])
def test_bad_completion_fields_are_400s_naming_them(server, field, value):
    body = {"model": NAME, "prompt": "hello", "max_tokens": 4, field: value}
    error = post_error(server.url, "/v1/completions", body, 400)
    assert error["param"] == field and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "num_speculative_tokens": -2}, "num_speculative_tokens"),
])
def test_bad_chat_fields_are_400s_naming_them(server, body, param):
    assert post_error(server.url, "/v1/chat/completions", {"model": NAME, **body}, 400)["param"] == param


def test_bad_json_and_unknown_models(server):
    assert post_error(server.url, "/v1/completions", "{not json", 400)["param"] is None
    error = post_error(server.url, "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404)
    assert error["param"] == "model" and "gpt-9" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client(server.url).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_a_failed_step_is_a_500_and_the_server_keeps_serving(server, tokenizer):
    c = client(server.url)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        c.completions.create(model=NAME, prompt="FAULT", max_tokens=8, temperature=0)
    with pytest.raises(openai.APIError, match="injected fault"):
        list(c.completions.create(model=NAME, prompt="a FAULT", max_tokens=8, temperature=0, stream=True))
    out = c.completions.create(model=NAME, prompt="hello", max_tokens=8, temperature=0)
    assert out.choices[0].text == _text(tokenizer, "hello", 8)


def test_a_disconnect_aborts_the_request_and_frees_its_blocks(server):
    before = metrics(server.url)
    with httpx.Client(timeout=REQUEST_TIMEOUT) as http:
        with http.stream("POST", f"{server.url}/v1/completions",
                         json={"model": NAME, "prompt": "long", "max_tokens": 500, "stream": True}) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(6)]       # a few chunks arrive, then the client goes away
    gone = lambda: metrics(server.url)[("vllm:request_success_total", (("finished_reason", "abort"),))] \
        == before[("vllm:request_success_total", (("finished_reason", "abort"),))] + 1   # noqa: E731
    assert wait_for(gone)
    assert wait_for(lambda: metrics(server.url)[("vllm:kv_cache_usage_perc", ())] == 0)
    assert metrics(server.url)[("vllm:num_requests_running", ())] == 0


def test_many_concurrent_streams(server, tokenizer):
    prompts = [f"p{i}" for i in range(64)]
    results = [None] * len(prompts)

    def run(i: int) -> None:
        chunks = client(server.url).completions.create(model=NAME, prompt=prompts[i], max_tokens=24, temperature=0,
                                                       stream=True)
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT)
    assert results == [_text(tokenizer, p, 24) for p in prompts]
    assert wait_for(lambda: metrics(server.url)[("vllm:kv_cache_usage_perc", ())] == 0)


def test_metrics_agree_with_the_responses(server):
    before = metrics(server.url)
    c = client(server.url)
    outs = [c.completions.create(model=NAME, prompt=f"m{i}", max_tokens=5 + i, temperature=0, stop="ö")
            for i in range(4)]
    outs.append(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=7))
    after = metrics(server.url)
    delta = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0)   # noqa: E731
    assert delta("vllm:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert delta("vllm:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    reasons = [o.choices[0].finish_reason for o in outs]
    for reason in ("stop", "length"):
        assert delta("vllm:request_success_total", (("finished_reason", reason),)) == reasons.count(reason)
    spec = [o.model_extra["spec_decode"] for o in outs]
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in spec)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in spec)
    per_pos = sum(delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))
                  for p in range(3))
    assert per_pos == delta("vllm:spec_decode_num_accepted_tokens_total")
    assert delta("vllm:time_to_first_token_seconds_count") == len(outs)
    assert delta("vllm:spec_decode_num_drafts_total") > 0


def test_a_hub_id_is_served_under_its_name(checkpoint, tmp_path, monkeypatch):
    """``--model ORG/NAME`` from a Hub cache under $HF_HOME, offline: /v1/models lists the id."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)             # else it, not $HF_HOME/hub, is the cache
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    cache_repo(tmp_path / "home" / "hub", "org/tiny-bytes", checkpoint)
    process = ServerProcess(["--model", "org/tiny-bytes"], tmp_path / "hub.log", fake=True,
                            env={"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"})
    try:
        assert [m.id for m in client(process.url).models.list().data] == ["org/tiny-bytes"]
    finally:
        assert process.stop(signal.SIGTERM) == 0, process.stderr()


def test_a_full_queue_is_a_429(checkpoint, tmp_path):
    process = ServerProcess(["--model", str(checkpoint), "--max-num-seqs", "1", "--max-waiting", "1"],
                            tmp_path / "queue.log", fake=True, env={"SCV_FAKE_STEP_SECONDS": "0.02"})
    try:
        c = client(process.url)
        streams = [c.completions.create(model=None, prompt="x", max_tokens=400, stream=True) for _ in range(2)]
        with pytest.raises(openai.RateLimitError):
            c.completions.create(prompt="y", max_tokens=2, model=None)
        for stream in streams:
            stream.close()
        assert wait_for(lambda: metrics(process.url)[("vllm:num_requests_running", ())] == 0)
        assert c.completions.create(prompt="y", max_tokens=2, model=None).usage.completion_tokens == 2
    finally:
        assert process.stop(signal.SIGTERM) == 0, process.stderr()


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(checkpoint, tmp_path, tokenizer):
    process = ServerProcess(["--model", str(checkpoint)], tmp_path / "term.log", fake=True,
                            env={"SCV_FAKE_STEP_SECONDS": "0.01"})
    stream = client(process.url).completions.create(model=None, prompt="hello", max_tokens=100, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    process.process.send_signal(signal.SIGTERM)
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks)
    assert text == _text(tokenizer, "hello", 100)
    assert process.wait() == 0                    # the one SIGTERM ends it
    assert "stopped" in process.stderr()


@pytest.mark.parametrize("include_usage", [None, False, True])
def test_stream_options_include_usage(server, include_usage):
    options = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    body = {"model": NAME, "prompt": "hello", "max_tokens": 7, "stream": True, **options}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if not include_usage:
        assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
        return
    *chunks, last = chunks
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                                       "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("path,first", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_stream_options_need_stream(server, path, first):
    body = {"model": NAME, **first, "stream_options": {"include_usage": True}}
    assert post_error(server.url, path, body, 400)["param"] == "stream_options"
    assert post_error(server.url, path, {**body, "stream": False}, 400)["param"] == "stream_options"


@pytest.mark.parametrize("content,headers,param,says", [
    (b'{"model": "tiny", "prompt": "caf\xe9"}', JSON, None, "not valid UTF-8"),
    (b'{"model": "tiny", "prompt": "\\ud800"}', JSON, None, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "\\udfff x"}', JSON, None, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "x"}', {}, None, "Content-Type: application/json"),
    (b'{"model": "tiny", "prompt": "x"}', {"content-type": "text/plain"}, None, "Content-Type: application/json"),
    (b'[1, 2]', JSON, None, "JSON object"),
    (b'', JSON, None, "not valid JSON"),
    (b'{"model": "tiny"}', JSON, "prompt", "prompt: Field required"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "3"}', JSON, "max_tokens", "max_tokens"),
    (b'{"model": "tiny", "prompt": {"text": "x"}}', JSON, "prompt", "prompt"),
])
def test_malformed_bodies_are_openai_400s(server, content, headers, param, says):
    tracebacks = server.stderr().count("Traceback")
    error = post_error(server.url, "/v1/completions", content, 400, headers)
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error", error
    assert server.stderr().count("Traceback") == tracebacks


def test_unknown_paths_and_methods_are_openai_errors(server):
    assert post_error(server.url, "/v1/nothing", {}, 404)["type"] == "invalid_request_error"
    response = httpx.get(f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT)
    assert response.status_code == 405 and response.json()["error"]["code"] == 405


def test_bodies_and_prompts_are_bounded(server):
    error = post_error(server.url, "/v1/completions", {"model": NAME, "prompt": "x" * MAX_BYTES}, 413)
    assert "--max-request-bytes" in error["message"]
    chunks = iter([b'{"model": "tiny", "prompt": "', *[b"x" * 100_000] * 21, b'"}'])    # no Content-Length
    response = httpx.post(f"{server.url}/v1/completions", content=chunks, headers=JSON, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]
    # checked before tokenizing: the error is the character limit's, not the context's
    error = post_error(server.url, "/v1/completions", {"model": NAME, "prompt": "x" * (MAX_CHARS + 1)}, 400)
    assert error["param"] == "prompt" and "--max-prompt-chars" in error["message"]
    body = {"model": NAME, "messages": [{"role": "user", "content": "x" * MAX_CHARS}]}
    error = post_error(server.url, "/v1/chat/completions", body, 400)
    assert error["param"] == "messages" and "--max-prompt-chars" in error["message"]


def test_a_long_prompt_does_not_hold_up_the_server(server):
    """Tokenizing the longest prompt allowed (0.5 to 1.5 s here) leaves /health answering at once."""
    prompt = "héllo wörld " * (MAX_CHARS // 12)
    result = {}

    def send() -> None:
        start = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": prompt},
                              timeout=REQUEST_TIMEOUT)
        result.update(status=response.status_code, param=response.json()["error"]["param"],
                      seconds=time.monotonic() - start)

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    while thread.is_alive() and len(latencies) < 10_000:
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=REQUEST_TIMEOUT).status_code == 200
        latencies.append(time.monotonic() - start)
    thread.join(REQUEST_TIMEOUT)
    assert (result["status"], result["param"]) == (400, "prompt")        # tokenized: too long for the context
    assert result["seconds"] > 0.3 and max(latencies) < result["seconds"] / 3, (result, max(latencies))


def _slow_server(checkpoint, log, *flags: str) -> ServerProcess:
    """A server whose fake engine steps every 50 ms: a request of 1500 tokens runs for ~30 s."""
    return ServerProcess(["--model", str(checkpoint), "--max-model-len", "2048", *flags], log, fake=True,
                         env={"SCV_FAKE_STEP_SECONDS": "0.05"})


def test_a_client_leaving_a_whole_response_aborts_it_at_once(checkpoint, tmp_path):
    process = _slow_server(checkpoint, tmp_path / "gone.log")
    abort = ("vllm:request_success_total", (("finished_reason", "abort"),))
    try:
        with pytest.raises(httpx.ReadTimeout):      # the client gives up after 1 s and closes the connection
            httpx.post(f"{process.url}/v1/completions", json={"prompt": "x", "max_tokens": 1500},
                       timeout=httpx.Timeout(REQUEST_TIMEOUT, read=1.0))
        assert wait_for(lambda: metrics(process.url).get(abort) == 1, timeout=5)
        assert wait_for(lambda: metrics(process.url)[RUNNING] == 0, timeout=5)
    finally:
        assert process.stop(signal.SIGTERM) == 0, process.stderr()


def test_requests_past_the_shutdown_timeout_end_saying_why(checkpoint, tmp_path):
    process = _slow_server(checkpoint, tmp_path / "shutdown.log", "--shutdown-timeout", "1")
    body, whole, signalled = {"prompt": "x", "max_tokens": 1500}, {}, None
    thread = threading.Thread(target=lambda: whole.update(response=httpx.post(
        f"{process.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT)))
    try:
        with httpx.stream("POST", f"{process.url}/v1/completions", json={**body, "stream": True},
                          timeout=REQUEST_TIMEOUT) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            thread.start()
            assert wait_for(lambda: metrics(process.url)[RUNNING] == 2, timeout=10)
            process.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            events = [line for line in lines if line]
        ended = time.monotonic() - signalled
        thread.join(REQUEST_TIMEOUT)
    finally:
        status = process.stop(signal.SIGTERM) if signalled is None else process.wait()
        assert status == 0, process.stderr()
    assert events[-1] == "data: [DONE]" and 1 <= ended < 10, (events[-3:], ended)
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert whole["response"].status_code == 503 and "shutting down" in whole["response"].json()["error"]["message"]
    assert "Traceback" not in process.stderr() and "stopped" in process.stderr()
