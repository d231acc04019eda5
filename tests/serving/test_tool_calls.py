"""Tool calls through ``scv-jax serve`` with the ``openai`` client (the tiny byte-level checkpoint with a
chat template that renders tools and writes ``<tool_call>`` blocks, so "auto" parses with hermes;
n-gram drafting): "required" and named calls are constrained to the tools' schemas and come back as
``tool_calls`` with finish_reason "tool_calls", streamed as deltas that reassemble to the same calls;
"auto" parses a canned output (a ``guided_choice`` makes the model write it); "none" renders the tools
and parses nothing; tool messages are accepted; the legacy ``functions``; bad tools are 400s naming
the field."""

from __future__ import annotations

import json
import signal

import pytest

from tests.serving.conftest import client, post_error
from tests.serving.harness import ServerProcess

NAME = "tiny"
CHAT = "/v1/chat/completions"
COMMON = ["--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "320", "--max-num-seqs", "4",
          "--no-warmup", "--ngram", "--k", "3"]
TOOLS_HEADER = "### system\nCall one of {names} as <tool_call>{{...}}</tool_call>\n"
TEMPLATE = ("{% if tools %}### system\nCall one of {% for tool in tools %}{{ tool['function']['name'] }}"
            "{% if not loop.last %}, {% endif %}{% endfor %} as <tool_call>{...}</tool_call>\n{% endif %}"
            "{% for message in messages %}### {{ message['role'] }}\n{% if message['content'] %}"
            "{{ message['content'] }}{% endif %}{% for call in message['tool_calls'] or [] %}"
            "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}### assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    from scv_jax.demo.hf_export import write_checkpoint

    model = write_checkpoint(tmp_path_factory.mktemp("tools") / "tiny-tools")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    process = ServerProcess(["--model", str(model), *COMMON], tmp_path_factory.mktemp("logs") / "tools.log")
    yield process
    assert process.stop(signal.SIGTERM) == 0, process.stderr()


def _valid(name: str, arguments: str) -> bool:
    """A call's arguments parse and validate against its tool's schema."""
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and \
            isinstance(args["days"], int) and 1 <= args["days"] <= 7
    return name == "get_time" and set(args) == {"zone"} and isinstance(args["zone"], str) and len(args["zone"]) <= 6


def _calls(message) -> list[tuple[str, str]]:
    assert message.content is None and message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    return [(call.function.name, call.function.arguments) for call in message.tool_calls]


def _streamed(api, **kwargs) -> tuple[list[tuple[str, str]], str, str]:
    """The calls a stream's tool-call deltas reassemble to, its content and its finish reason."""
    calls: dict[int, list] = {}
    content, reasons = "", []
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reasons += [choice.finish_reason] if choice.finish_reason else []
        for delta in choice.delta.tool_calls or ():
            if delta.index not in calls:        # the first delta of a call: its id and name
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments
    assert len(reasons) == 1 and sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))], content, reasons[0]


@pytest.mark.slow
def test_named_call_is_constrained_and_streams_the_same(server):
    api = client(server.url)
    kwargs = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=60,
                  temperature=0)
    out = api.chat.completions.create(**kwargs)
    calls = _calls(out.choices[0].message)
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0][0] == "get_weather" and _valid(*calls[0]), calls
    assert _streamed(api, **kwargs) == (calls, "", "tool_calls")
    for seed in range(3):           # sampled: each a valid call
        out = api.chat.completions.create(**{**kwargs, "temperature": 1.0, "seed": seed})
        (call,) = _calls(out.choices[0].message)
        assert call[0] == "get_weather" and _valid(*call), call


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_any_tool(server, parallel):
    api = client(server.url)
    kwargs = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
                  parallel_tool_calls=parallel)
    for seed in range(3):
        out = api.chat.completions.create(**kwargs, temperature=1.0, seed=seed)
        if out.choices[0].finish_reason == "length":       # a long sampled array: not one whole call list
            assert parallel and out.choices[0].message.content.startswith('[{"name":')
            continue
        calls = _calls(out.choices[0].message)
        assert out.choices[0].finish_reason == "tool_calls" and all(_valid(*call) for call in calls), calls
        assert len(calls) == 1 if not parallel else len(calls) >= 1
    if parallel:                    # greedy, the tiny model goes on calling: several calls, streamed as they come
        calls, content, reason = _streamed(api, **kwargs, temperature=0)
        assert len(calls) >= 2 and content == "" and reason in ("length", "tool_calls"), (calls, reason)
        assert all(_valid(*call) for call in calls[:-1 if reason == "length" else None]), calls
        return
    out = api.chat.completions.create(**kwargs, temperature=0)
    assert out.choices[0].finish_reason == "tool_calls"
    assert _streamed(api, **kwargs, temperature=0) == (_calls(out.choices[0].message), "", "tool_calls")


CANNED_CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_calls(server, stream):
    """The template writes ``<tool_call>``: hermes. The model is made to write a canned text."""
    api = client(server.url)
    for text, content, calls in [("Let me look. " + CANNED_CALL, "Let me look.", [("get_time", '{"zone": "UTC"}')]),
                                 ("It is sunny.", "It is sunny.", [])]:
        kwargs = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
                      extra_body={"guided_choice": [text]})
        if stream:
            got_calls, got_content, reason = _streamed(api, **kwargs)
            assert got_calls == calls and got_content.strip() == content
        else:
            choice = api.chat.completions.create(**kwargs).choices[0]
            reason = choice.finish_reason
            got_calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
            assert got_calls == calls and choice.message.content.strip() == content
        assert reason == ("tool_calls" if calls else "stop")


def test_llama3_json_parser_flag(checkpoint, tmp_path):
    """``--tool-call-parser llama3_json`` overrides the template's format: a message that is a JSON call
    is a call (streamed: held back, then sent as deltas); other text is content."""
    process = ServerProcess(["--model", str(checkpoint), *COMMON, "--tool-call-parser", "llama3_json"],
                            tmp_path / "llama3.log")
    try:
        api = client(process.url)
        call = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
        for text, content, calls in [(call, None, [("get_time", '{"zone": "UTC"}')]), ("Paris " + call, None, [])]:
            kwargs = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
                          extra_body={"guided_choice": [text]})
            choice = api.chat.completions.create(**kwargs).choices[0]
            got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
            assert (got, choice.message.content) == (calls, None if calls else text)
            assert choice.finish_reason == ("tool_calls" if calls else "stop")
            assert _streamed(api, **kwargs) == (calls, "" if calls else text, choice.finish_reason)
    finally:
        assert process.stop(signal.SIGTERM) == 0, process.stderr()


def test_none_renders_the_tools_and_parses_nothing(server):
    api = client(server.url)
    plain = api.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=100, temperature=0,
                                        extra_body={"guided_choice": [CANNED_CALL]})
    none = api.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=100, temperature=0, tools=[WEATHER],
                                       tool_choice="none", extra_body={"guided_choice": [CANNED_CALL]})
    header = TOOLS_HEADER.format(names="get_weather")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens + len(header)
    assert none.choices[0].message.content == CANNED_CALL and not none.choices[0].message.tool_calls
    assert none.choices[0].finish_reason == "stop"


def test_tool_messages_go_to_the_template(server):
    api = client(server.url)
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    short = api.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    out = api.chat.completions.create(model=NAME, messages=history, max_tokens=4, temperature=0)
    rendered = ('### assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
                '</tool_call>\n### tool\nsunny, 21 C\n')
    assert out.usage.prompt_tokens == short.usage.prompt_tokens + len(rendered.encode())


def test_legacy_functions(server):
    api = client(server.url)
    kwargs = dict(model=NAME, messages=MESSAGES, functions=[WEATHER["function"]], function_call={"name": "get_weather"},
                  max_tokens=60, temperature=0)
    choice = api.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.content is None
    call = choice.message.function_call
    assert call.name == "get_weather" and _valid(call.name, call.arguments) and not choice.message.tool_calls
    name, arguments, reasons = None, "", []
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        if delta.function_call:
            name = name or delta.function_call.name
            arguments += delta.function_call.arguments or ""
    assert (name, arguments, reasons) == (call.name, call.arguments, ["function_call"])


@pytest.mark.parametrize("fields, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}]}, "tools"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"minimum": "x"}}}}]},
     "functions"),
])
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    error = post_error(server.url, CHAT, {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **fields}, 400)
    assert error["param"] == param, error
