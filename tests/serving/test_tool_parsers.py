"""The tool-call decoders on strings (no server): vLLM's ``hermes`` and ``llama3_json`` formats parsed
(calls, text-only, malformed), the template rule, forced calls' text split into deltas at every cut
reassembling to the calls, and "auto" streaming content only where no call can start; the checks of
``tools`` / ``tool_choice`` (a 400 naming the field)."""

from __future__ import annotations

import json
import random

import pytest

from scv_jax.serving.protocol import ApiError, ChatRequest
from scv_jax.serving.tools import (AutoCalls, ForcedCalls, parse_hermes, parse_llama3_json, template_parser,
                                   tool_set)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
    ('Let me check. <tool_call>{"name": "f", "arguments": {"a": "}"}}</tool_call>\n<tool_call>{"name": "g", '
     '"arguments": {}}</tool_call>', "Let me check.", [("f", {"a": "}"}), ("g", {})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),        # unclosed at the end
    ("just text, no call", "just text, no call", []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', None, "malformed"),      # not JSON
    ('<tool_call>{"nam": "f"}</tool_call>', None, "malformed"),                           # not a call
])
def test_hermes(text, content, calls):
    got = parse_hermes(text)
    assert got == ((text, []) if calls == "malformed" else (content, calls))


@pytest.mark.parametrize("text, calls", [
    ('{"name": "f", "parameters": {"a": [1, 2]}}', [("f", {"a": [1, 2]})]),
    ('<|python_tag|>{"name": "f", "arguments": {}}', [("f", {})]),
    ('  {"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}\n', [("f", {"x": "y"}), ("g", {})]),
    ("The weather is fine.", "text"),
    ('The call is {"name": "f", "parameters": {}}', "text"),            # not the whole message
    ('{"name": "f", "parameters": {"a": 1}', "text"),                   # malformed
    ('{"name": "f", "parameters": {}} and more', "text"),
    ('{"city": "Paris"}', "text"),                                     # JSON, not a call
])
def test_llama3_json(text, calls):
    assert parse_llama3_json(text) == ((text, []) if calls == "text" else (None, calls))


def test_template_rule():
    assert template_parser("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}") == "hermes"
    assert template_parser("{{- '<|python_tag|>' + tool_call }}") == "llama3_json"
    assert template_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert template_parser("{{ messages }}") is None and template_parser(None) is None


def _deltas(decoder, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    content, deltas, at = "", [], 0
    for cut in [*cuts, len(text)]:
        more, new = decoder.feed(text[at:cut])
        content, deltas, at = content + more, deltas + new, cut
    more, new = decoder.finish()
    return content + more, deltas + new


def _assembled(deltas: list[dict]) -> list[tuple[str, str]]:
    """The calls of OpenAI's tool-call deltas: (name, arguments text) by index; each call's first delta
    has its id and name."""
    calls: dict[int, list] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert delta["id"].startswith("call_") and delta["type"] == "function" and delta["function"]["name"]
            calls[delta["index"]] = [delta["function"]["name"], delta["function"]["arguments"]]
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]][1] += delta["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))]


def test_forced_calls_reassemble_at_every_cut():
    rng = random.Random(0)
    required = json.dumps([{"name": "get_weather", "parameters": {"city": "Pa}r\\\"is", "n": [1, {"a": [2]}]}},
                           {"name": "get_time", "parameters": {}}], separators=(",", ":"))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(required)), rng.randrange(0, 12)))
        content, deltas = _deltas(ForcedCalls(None), required, cuts)
        assert content == "" and _assembled(deltas) == [
            ("get_weather", '{"city":"Pa}r\\\\\\"is","n":[1,{"a":[2]}]}'), ("get_time", "{}")]
        assert [json.loads(a) for _, a in _assembled(deltas)] == [p["parameters"] for p in json.loads(required)]
    named = '{"city":"Oslo"}'
    content, deltas = _deltas(ForcedCalls("get_weather"), named, [3, 4, 9])
    assert content == "" and _assembled(deltas) == [("get_weather", named)]


@pytest.mark.parametrize("parser, text, streamed, content, calls", [
    ("hermes", 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "Sure. ", "",
     [("f", '{"a": 1}')]),
    ("hermes", "No call here, <tool but not quite", "No call here, <tool but not quite", "", []),
    ("hermes", "<tool_call>{broken</tool_call>", "", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"b": "x"}}', "", "", [("f", '{"b": "x"}')]),
    ("llama3_json", "Paris is sunny. {not a call}", "Paris is sunny. {not a call}", "", []),
    ("llama3_json", '{"name": "f", "param', "", '{"name": "f", "param', []),
])
def test_auto_streams_content_until_a_call_may_start(parser, text, streamed, content, calls):
    for cuts in ([], list(range(1, len(text))), [2, 7, 15]):
        decoder = AutoCalls(parser, parallel=True)
        out, at = "", 0
        for cut in [*cuts, len(text)]:
            more, deltas = decoder.feed(text[at:cut])
            assert deltas == []
            out, at = out + more, cut
        assert out == streamed
        more, deltas = decoder.finish()
        assert more == content and _assembled(deltas) == calls


def test_auto_without_parallel_keeps_the_first_call():
    decoder = AutoCalls("llama3_json", parallel=False)
    decoder.feed('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}')
    assert _assembled(decoder.finish()[1]) == [("f", "{}")]


def _request(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_set_forced_constraints():
    tools = tool_set(_request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(tools.constraint().json)
    assert schema["type"] == "array" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = tool_set(_request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}))
    assert json.loads(named.constraint().json) == WEATHER["function"]["parameters"]
    auto = tool_set(_request(tools=[WEATHER]))
    assert (auto.choice, auto.parallel, auto.constraint()) == ("auto", True, None)
    legacy = tool_set(_request(functions=[WEATHER["function"]], function_call={"name": "get_weather"}))
    assert legacy.legacy and not legacy.parallel and legacy.choice == "get_weather"
    assert tool_set(_request(tools=[], tool_choice="none", functions=[], function_call="auto")) is None


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"tools": [WEATHER], "function_call": {"name": "get_weather"}}, "function_call"),
])
def test_bad_tools_name_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        tool_set(_request(**fields))
    assert (e.value.status, e.value.param) == (400, param) and param in e.value.message
