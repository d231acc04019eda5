"""Tool calls of ``/v1/chat/completions``: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
(and the legacy ``functions`` / ``function_call``) checked, turned into an output constraint or a
parser, and the output turned into OpenAI's ``tool_calls``.

- ``tool_choice`` "required" or a named function: the output is constrained (structured output, a JSON
  schema) to calls of the tools: a named function's ``parameters`` object alone (one call), "required":
  a JSON array of ``{"name": a tool's name, "parameters": its parameters}`` (one item when
  ``parallel_tool_calls`` is false). ``ForcedCalls`` turns that text into tool-call deltas as it comes.
- "auto": the tools go to the chat template and the model's own format is parsed (``PARSERS``: vLLM's
  ``hermes`` and ``llama3_json``); ``AutoCalls`` streams the text as content until a call may start,
  then holds it back to the end.
- "none": the tools go to the chat template; nothing is parsed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable

from scv_jax.sampling_params import StructuredOutputsParams
from scv_jax.serving.protocol import ApiError, ChatRequest

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolSet:
    """A request's tools, checked. ``functions``: {name: {"name", "description"?, "parameters"}};
    ``choice``: "none", "auto", "required" or a function's name; ``parallel``: several calls allowed;
    ``legacy``: given as ``functions`` / ``function_call`` (answered as ``message.function_call``)."""

    functions: dict[str, dict[str, Any]]
    choice: str
    parallel: bool
    legacy: bool

    @property
    def field(self) -> str:
        return "functions" if self.legacy else "tools"

    @property
    def choice_field(self) -> str:
        return "function_call" if self.legacy else "tool_choice"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template gets them (transformers' ``tools=``: OpenAI's tool objects)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of a forced call (None for "auto" / "none")."""
        if not self.forced:
            return None
        if self.choice != "required":
            return StructuredOutputsParams(json=self.functions[self.choice]["parameters"])
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": f["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, f in self.functions.items()]
        array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        return StructuredOutputsParams(json=array if self.parallel else {**array, "maxItems": 1})


def _check_schema(schema: Any, where: str, field: str) -> None:
    """400 naming ``field`` when ``schema`` is not a JSON schema llguidance compiles."""
    import llguidance

    if not isinstance(schema, dict):
        raise ApiError(400, f"{where}.parameters must be a JSON schema object, got {json.dumps(schema)[:200]}", field)
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise ApiError(400, f"{where}.parameters is not a valid JSON schema: {error.splitlines()[0]}", field)


def _function(spec: Any, where: str, field: str) -> dict[str, Any]:
    """A function's definition (``name``, ``description``, ``parameters``, ``strict``), checked."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
        raise ApiError(400, f"{where} must be an object with a name of 1 to 64 letters, digits, '_' or '-', got "
                            f"{json.dumps(spec)[:200]}", field)
    unknown = sorted(set(spec) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ApiError(400, f"{where}: unknown key {unknown[0]!r}", field)
    if not isinstance(spec.get("description", ""), str):
        raise ApiError(400, f"{where}.description must be a string", field)
    parameters = spec.get("parameters", _EMPTY_PARAMETERS)
    _check_schema(parameters, where, field)
    return {**spec, "parameters": parameters}


def _chosen_name(choice: Any, field: str, names: dict[str, Any], legacy: bool) -> str:
    """``tool_choice`` / ``function_call`` as "none", "auto", "required" or a function's name."""
    if isinstance(choice, str) and choice in ("none", "auto", *(() if legacy else ("required",))):
        return choice
    if isinstance(choice, dict):
        name = choice.get("name") if legacy else (choice.get("function") or {}).get("name") \
            if choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
        if isinstance(name, str):
            if name not in names:
                among = "functions" if legacy else "tools"
                raise ApiError(400, f"{field} names {name!r}, which is not among the {among} "
                                    f"({', '.join(names) or 'none given'})", field)
            return name
    shape = '"none", "auto" or {"name": ...}' if legacy else \
        '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    raise ApiError(400, f"{field} must be {shape}, got {json.dumps(choice)[:200]}", field)


def tool_set(request: ChatRequest) -> ToolSet | None:
    """The request's tools (None when it gives none); a bad one is a 400 naming the field."""
    legacy = bool(request.functions)
    if legacy and request.tools:
        raise ApiError(400, "functions and tools: send one of the two (functions is the legacy form)", "functions")
    field, choice_field = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    other, other_field = ("tool_choice", "tools") if legacy else ("function_call", "functions")
    if getattr(request, other) not in (None, "none", "auto"):
        raise ApiError(400, f"{other} {json.dumps(getattr(request, other))} needs {other_field}", other)
    given = request.functions if legacy else request.tools
    functions: dict[str, dict[str, Any]] = {}
    for i, spec in enumerate(given or ()):
        where = f"{field}[{i}]"
        if not legacy:
            if not isinstance(spec, dict) or spec.get("type") != "function" or set(spec) != {"type", "function"}:
                raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}, got '
                                    f"{json.dumps(spec)[:200]}", field)
            spec, where = spec["function"], where + ".function"
        function = _function(spec, where, field)
        if function["name"] in functions:
            raise ApiError(400, f"{where}: the name {function['name']!r} is given twice", field)
        functions[function["name"]] = function
    choice = getattr(request, choice_field)
    name = _chosen_name("auto" if choice is None else choice, choice_field, functions, legacy)
    if not functions:
        if name not in ("none", "auto"):
            raise ApiError(400, f"{choice_field} {json.dumps(choice)} needs {field}", choice_field)
        return None
    parallel = not legacy and request.parallel_tool_calls is not False
    return ToolSet(functions, name, parallel, legacy)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


Delta = dict[str, Any]      # one tool call's delta: {"index", "id"?, "type"?, "function": {"name"?, "arguments"}}


def _header(index: int, name: str, arguments: str = "") -> Delta:
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class ForcedCalls:
    """The text of a forced call (``ToolSet.constraint``) as tool-call deltas, as it comes: ``feed(text)``
    -> deltas (a call's id and name once its name is out, then its arguments' text in fragments).
    ``named``: the text is that function's arguments alone; else a JSON array of calls."""

    _CALL = re.compile(r'[\s\[\],}]*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')

    def __init__(self, named: str | None):
        self.named, self.index, self.pending, self.in_call = named, -1, "", False
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        """(content, deltas): a forced call has no content."""
        if self.named is not None:
            deltas = [_header(0, self.named)] if self.index < 0 else []
            self.index = 0
            return "", deltas + ([{"index": 0, "function": {"arguments": text}}] if text else [])
        self.pending += text
        deltas: list[Delta] = []
        while True:
            if not self.in_call:
                match = self._CALL.match(self.pending)
                if match is None:
                    return "", deltas
                self.index += 1
                deltas.append(_header(self.index, json.loads(match.group(1))))
                self.pending, self.in_call, self.depth = self.pending[match.end():], True, 0
            end, done = self._value_end()
            fragment, self.pending = self.pending[:end], self.pending[end:]
            if fragment:
                deltas.append({"index": self.index, "function": {"arguments": fragment}})
            if not done:
                return "", deltas
            self.in_call = False

    def _value_end(self) -> tuple[int, bool]:
        """How much of ``pending`` belongs to the current call's arguments, and whether they end there."""
        for i, char in enumerate(self.pending):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]" or (char == "," and self.depth == 0):
                if self.depth == 0:
                    return i, True
                self.depth -= 1
        return len(self.pending), False

    def finish(self) -> tuple[str, list[Delta]]:
        return "", []


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    """vLLM's ``hermes`` parser (Qwen 2.5 / 3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` blocks (the last may be unclosed at the end); the text before the first is the
    content. Text without a call, or a block that is not such JSON: all content, no call."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.DOTALL):
        call = _call(block.strip(), "arguments")
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].strip() or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    """vLLM's ``llama3_json`` parser (Llama 3.1-3.3): the whole message is a call ``{"name": ...,
    "parameters": {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``, several separated by
    ``;``. Anything else: all content, no call."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_of(value, "parameters") or _call_of(value, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in "; \t\r\n":
            at += 1
    return None, calls


def _call_of(value: Any, key: str) -> tuple[str, dict[str, Any]] | None:
    if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get(key, {}), dict) \
            and set(value) <= {"name", key}:
        return value["name"], value.get(key, {})
    return None


def _call(text: str, key: str) -> tuple[str, dict[str, Any]] | None:
    try:
        return _call_of(json.loads(text), key)
    except ValueError:
        return None


PARSERS: dict[str, Callable[[str], tuple[str | None, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json}
TOOL_CALL_PARSERS = tuple(PARSERS)       # --tool-call-parser's choices


def template_parser(template_source: str | None) -> str | None:
    """The parser a chat template's tool-call format asks for: "hermes" when it writes ``<tool_call>``,
    "llama3_json" when it has Llama 3's ``<|python_tag|>`` or ``ipython`` role; None otherwise."""
    source = template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return None


class AutoCalls:
    """"auto": the text as content while no call can be in it; from where one may start (``<tool_call>``
    for hermes, a message starting with ``{`` or ``<|python_tag|>`` for llama3_json) held back and parsed
    at the end (``finish``)."""

    def __init__(self, parser: str, parallel: bool):
        self.parser, self.parallel, self.held, self.state = parser, parallel, "", "scan"   # or "content", "hold"

    def _may_start(self, text: str) -> int | None:
        """Where a call may start in ``text`` (None: nowhere, nor in text to come after it for llama3_json)."""
        if self.parser == "llama3_json":
            head, tag = text.lstrip(), "<|python_tag|>"
            return 0 if head.startswith(("{", tag)) or tag.startswith(head) else None
        at = text.find("<tool_call>")
        if at >= 0:
            return at
        return next((i for i in range(max(0, len(text) - 10), len(text)) if "<tool_call>".startswith(text[i:])),
                    len(text))

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        if self.state == "content":
            return text, []
        self.held += text
        if self.state == "hold":
            return "", []
        at = self._may_start(self.held)
        if at is None:                          # llama3_json: the message is text
            out, self.held, self.state = self.held, "", "content"
            return out, []
        out, self.held = self.held[:at], self.held[at:]
        if self.held.lstrip().startswith(("<tool_call>", "{", "<|python_tag|>")):
            self.state = "hold"
        return out, []

    def finish(self) -> tuple[str, list[Delta]]:
        held, self.held = self.held, ""
        if not held:
            return "", []
        content, calls = PARSERS[self.parser](held)
        if not self.parallel:
            calls = calls[:1]
        return content or "", [_header(i, name, json.dumps(args, ensure_ascii=False))
                               for i, (name, args) in enumerate(calls)]


def decoder(tools: ToolSet, parser: str | None) -> ForcedCalls | AutoCalls | None:
    """A choice's decoder of tool calls (None: its text is content)."""
    if tools.forced:
        return ForcedCalls(None if tools.choice == "required" else tools.choice)
    if tools.choice == "auto" and parser is not None:
        return AutoCalls(parser, tools.parallel)
    return None
