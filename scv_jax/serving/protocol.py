"""OpenAI request bodies (with vLLM's extensions), their check and their ``SamplingParams``; errors in
OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``).

Every field of OpenAI's completions and chat completions and of vLLM's extensions to them is declared:
one this server implements is honoured; one it does not is marked ``Unsupported``: accepted at the
values that ask for nothing (e.g. ``"echo": false``, ``"priority": 0``), a 400 naming it
otherwise; so are the few SGLang fields that the SGLang and vLLM routers add to every request. scv-jax
adds one field of its own, ``num_speculative_tokens`` (``SamplingParams``'). A field
none of them defines is left in ``unknown_fields`` (the server refuses it, or ignores it when told to).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Callable, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from scv_jax.sampling_params import MAX_BAD_WORD_LEN, MAX_BAD_WORDS, MAX_SEED, SamplingParams, StructuredOutputsParams

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An HTTP error answered as OpenAI's error JSON; ``param``: the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code or self.status}}


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A field's mark: this server does not implement it; values other than ``accepted`` (those that
    ask for nothing) are a 400 naming it, saying ``why``."""

    accepted: tuple[Any, ...]
    why: str


def _only(*accepted: Any, why: str = "is not implemented by this server") -> Unsupported:
    """Unsupported but for null and ``accepted``."""
    return Unsupported((None, *accepted), why)


MAX_CHOICES = 16   # the most choices (``n``) one request may ask for: each is an engine request
_STRUCTURED_BACKEND = "structured output runs on llguidance only"
_WHITESPACE = "JSON is generated compactly (no free whitespace)"
_MULTIMODAL = "the server serves text only"
_Json = dict[str, Any] | None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (``choices: []``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None
    continuous_usage_stats: Annotated[bool | None, _only(False)] = None
    include_obfuscation: Annotated[bool | None, _only(False)] = None


class BaseRequest(BaseModel):
    """Fields of both endpoints; strict types (a string is not a number, a bool not an int); fields no
    API defines are kept in ``model_extra``."""

    model_config = ConfigDict(strict=True, extra="allow")
    PROMPT_FIELD: ClassVar[str]           # the field holding the prompt
    LOGPROBS_FIELD: ClassVar[str]         # the field SamplingParams.logprobs comes from

    # OpenAI, honoured
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None                  # an end-user id: accepted, no effect on the output
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None   # {token id (a JSON key): bias in [-100, 100]}
    n: int | None = 1                        # choices, each an engine request (1 to MAX_CHOICES)
    best_of: int | None = None               # accepted as null or n only (``check``)
    # OpenAI, not implemented
    echo: Annotated[bool | None, _only(False)] = False
    response_format: _Json = None
    # vLLM, honoured
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None            # accepted: no KV cache is shared between requests
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None       # as token ids: ``bad_words_token_ids``
    # vLLM, not implemented
    length_penalty: Annotated[float | None, _only(1.0, why="beam search is not implemented")] = None
    use_beam_search: Annotated[bool | None, _only(False, why="beam search is not implemented")] = False
    skip_special_tokens: Annotated[bool | None, _only(True)] = True
    spaces_between_special_tokens: Annotated[bool | None, _only(True)] = True
    truncate_prompt_tokens: Annotated[int | None, _only()] = None
    prompt_logprobs: Annotated[int | None, _only()] = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Annotated[str | None, _only("llguidance", "auto", why=_STRUCTURED_BACKEND)] = None
    guided_whitespace_pattern: Annotated[str | None, _only(why=_WHITESPACE)] = None
    structured_outputs: _Json = None
    priority: Annotated[int | None, _only(0, why="priority scheduling is not implemented")] = 0
    request_id: Annotated[str | None, _only()] = None
    logits_processors: Annotated[list[Any] | None, _only([])] = None
    return_tokens_as_token_ids: Annotated[bool | None, _only(False)] = None
    return_token_ids: Annotated[bool | None, _only(False)] = None
    kv_transfer_params: Annotated[_Json, _only()] = None
    vllm_xargs: Annotated[_Json, _only({})] = None
    # SGLang's, sent at these values by the SGLang and vLLM routers (docs/serving.md, "Replicas behind a
    # router"), not implemented
    no_stop_trim: Annotated[bool | None, _only(False)] = None
    return_hidden_states: Annotated[bool | None, _only(False)] = None
    # scv-jax, honoured: the most drafts per step for this request (None: the engine's k; 0: it never drafts)
    num_speculative_tokens: int | None = None

    def check(self) -> None:
        """400 for a field set to a value this server does not implement, or fields that disagree."""
        _refuse_unsupported(self)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        n = self.num_choices()
        if not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"n must be an int in [1, {MAX_CHOICES}], got {n}", "n")
        if self.best_of is not None and self.best_of != n:
            raise ApiError(400, f"best_of other than n is not implemented (vLLM v1 dropped it; choices are not "
                                f"ranked): leave it out or send n ({n}), got {self.best_of}", "best_of",
                           "unsupported_parameter")

    def num_choices(self) -> int:
        """``n``: the choices asked for (null: 1)."""
        return 1 if self.n is None else self.n

    def max_tokens_field(self) -> str:
        """The field the output's length limit came from."""
        return "max_tokens"

    def max_new_tokens(self) -> int | None:
        """The output's length limit (None: the rest of the context)."""
        return getattr(self, self.max_tokens_field())

    def field_of(self, name: str) -> str:
        """The request field that a ``SamplingParams`` (or the engine's) ``name`` comes from."""
        if name == "structured_outputs":
            return next((field for field in ("response_format", "structured_outputs", *_GUIDED)
                         if getattr(self, field, None) is not None), name)
        return {"max_tokens": self.max_tokens_field(), "logprobs": self.LOGPROBS_FIELD,
                "prompt": self.PROMPT_FIELD, "bad_words_token_ids": "bad_words"}.get(name, name)


class CompletionRequest(BaseRequest):
    PROMPT_FIELD: ClassVar[str] = "prompt"
    LOGPROBS_FIELD: ClassVar[str] = "logprobs"

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    suffix: Annotated[str | None, _only("")] = None
    prompt_embeds: Annotated[str | list[str] | None, _only(why=_MULTIMODAL)] = None
    add_special_tokens: Annotated[bool | None, _only(True)] = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseRequest):
    PROMPT_FIELD: ClassVar[str] = "messages"
    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # OpenAI, accepted: ids and a cache key, no effect on the output (no cache is shared)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # OpenAI, honoured: tool calls (checked by ``tools.tool_set``)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI, not implemented
    reasoning_effort: Annotated[str | None, _only(why="the served model does not reason")] = None
    prediction: _Json = None                 # predicted outputs: {"type": "content", "content": ...}
    audio: Annotated[_Json, _only(why=_MULTIMODAL)] = None
    modalities: Annotated[list[str] | None, _only(["text"], why=_MULTIMODAL)] = None
    web_search_options: Annotated[_Json, _only(why="web search is not implemented")] = None
    verbosity: Annotated[str | None, _only()] = None
    moderation: Annotated[_Json, _only()] = None
    metadata: Annotated[dict[str, str] | None, _only({}, why="requests are not stored")] = None
    store: Annotated[bool | None, _only(False, why="requests are not stored")] = None
    service_tier: Annotated[str | None, _only("auto", "default")] = None
    prompt_cache_retention: Annotated[str | None, _only()] = None
    prompt_cache_options: Annotated[_Json, _only()] = None
    # vLLM, not implemented
    continue_final_message: Annotated[bool | None, _only(False)] = False
    add_special_tokens: Annotated[bool | None, _only(False)] = False
    chat_template: Annotated[str | None, _only(why="only the model's chat template is served")] = None
    chat_template_kwargs: Annotated[_Json, _only({})] = None
    documents: Annotated[list[Any] | None, _only([])] = None
    mm_processor_kwargs: Annotated[_Json, _only({}, why=_MULTIMODAL)] = None
    structural_tag: Annotated[str | None, _only(why="structural tags are not implemented (use tools)")] = None
    include_reasoning: bool | None = None     # accepted: the served model does not reason
    # SGLang's (sent by the routers, as above)
    separate_reasoning: bool | None = None    # accepted: the served model does not reason
    stream_reasoning: bool | None = None      # accepted: the served model does not reason

    def check(self) -> None:
        super().check()
        self.prediction_text()
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree: send one of them", "max_tokens")

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def field_of(self, name: str) -> str:
        if name == "structured_outputs" and structured_outputs(self) is None and (self.tools or self.functions):
            return "functions" if self.functions else "tools"       # a forced tool call's constraint
        return super().field_of(name)

    def prediction_text(self) -> str:
        """The text of ``prediction`` (OpenAI's predicted outputs: ``{"type": "content", "content": a string or
        a list of {"type": "text", "text": ...} parts}``; "" when absent); another shape is a 400 naming it."""
        prediction = self.prediction
        if prediction is None:
            return ""
        content = prediction.get("content")
        if prediction.get("type") == "content" and set(prediction) == {"type", "content"}:
            if isinstance(content, str):
                return content
            if isinstance(content, list) and all(isinstance(part, dict) and set(part) == {"type", "text"} and
                                                 part["type"] == "text" and isinstance(part["text"], str)
                                                 for part in content):
                return "".join(part["text"] for part in content)
        raise ApiError(400, 'prediction must be {"type": "content", "content": a string or a list of '
                            f'{{"type": "text", "text": ...}} parts}}, got {json.dumps(prediction)[:200]}',
                       "prediction")


Body = TypeVar("Body", bound=BaseRequest)


def parse_request(raw: bytes, content_type: str | None, model: type[Body]) -> Body:
    """The request of a JSON body, its fields checked: a 400 for a body that is not JSON (or not sent as
    JSON), not UTF-8 or holds a lone surrogate escape, for a field of the wrong type or a value this
    server does not implement, each naming the field where one is involved."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(400, f"the request body must be JSON, sent with Content-Type: application/json (got "
                            f"{'Content-Type: ' + content_type if content_type else 'no Content-Type'})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        request = model.model_validate_json(text)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    request.check()
    return request


def _refuse_unsupported(model: BaseModel, param: str | None = None) -> None:
    """400 for a field marked ``Unsupported`` set to a value other than its accepted ones."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        for mark in field.metadata:
            if isinstance(mark, Unsupported) and not any(_same(value, a) for a in mark.accepted):
                shown = " or ".join(json.dumps(a) for a in mark.accepted)
                raise ApiError(400, f"{name} {mark.why}: leave it out or send {shown}, got {json.dumps(value)}",
                               param or name, "unsupported_parameter")
        if isinstance(value, BaseModel):
            _refuse_unsupported(value, param or name)


def _same(value: Any, accepted: Any) -> bool:
    """``value == accepted`` where True is not 1 (nor False 0)."""
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def unknown_fields(request: BaseRequest) -> list[str]:
    """The request's fields that neither OpenAI nor vLLM define."""
    return sorted(request.model_extra or {})


def stop_strings(request: BaseRequest) -> tuple[str, ...]:
    stop = request.stop
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(request: BaseRequest) -> dict[int, float]:
    """``logit_bias`` with its JSON keys as token ids (a key that is not an integer is a 400 naming it)."""
    bias = request.logit_bias or {}
    bad = [key for key in bias if not re.fullmatch(r"\s*-?\d+\s*", key)]
    if bad:
        raise ApiError(400, f"logit_bias: keys must be token ids (integers), got {json.dumps(bad[0])}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def bad_words_token_ids(words: list[str] | None, encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token ids, with vLLM's variants of a word: its tokens without leading spaces,
    and with one leading space where that starts with another token and is as many tokens (a word's
    last token is masked where the output ends with its other tokens). A word of no token or more than
    ``MAX_BAD_WORD_LEN``, or more than ``MAX_BAD_WORDS`` words of several tokens, is a 400 naming
    ``bad_words``."""
    ids: dict[tuple[int, ...], None] = {}
    for word in words or ():
        bare = tuple(encode(word.lstrip()))
        if not 1 <= len(bare) <= MAX_BAD_WORD_LEN:
            raise ApiError(400, f"bad_words: a word must be 1 to {MAX_BAD_WORD_LEN} tokens, {json.dumps(word)} is "
                                f"{len(bare)}", "bad_words")
        spaced = tuple(encode(" " + word.lstrip()))
        ids[bare] = None
        if spaced[:1] != bare[:1] and len(spaced) == len(bare):
            ids[spaced] = None
    if sum(len(word) > 1 for word in ids) > MAX_BAD_WORDS:
        raise ApiError(400, f"bad_words: at most {MAX_BAD_WORDS} words of several tokens (with vLLM's variants), "
                            f"got {sum(len(word) > 1 for word in ids)}", "bad_words")
    return tuple(ids)


def sampling_params(request: BaseRequest, max_tokens: int, logprobs: int | None,
                    encode: Callable[[str], list[int]] | None = None) -> SamplingParams:
    """The request's ``SamplingParams`` (OpenAI's defaults: temperature 1, top_p 1); ``encode`` tokenizes
    ``bad_words`` (without special tokens); a bad value is a 400 naming the request's field."""
    fields = dict(temperature=1.0 if request.temperature is None else request.temperature,
                  top_p=1.0 if request.top_p is None else request.top_p,
                  top_k=0 if request.top_k is None else request.top_k,
                  min_p=0.0 if request.min_p is None else request.min_p,
                  seed=request.seed, max_tokens=max_tokens, stop_token_ids=tuple(request.stop_token_ids or ()),
                  ignore_eos=request.ignore_eos, logprobs=logprobs,
                  presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
                  repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                  logit_bias=_logit_bias(request), allowed_token_ids=request.allowed_token_ids,
                  bad_words_token_ids=bad_words_token_ids(request.bad_words, encode) if request.bad_words else (),
                  min_tokens=request.min_tokens or 0, num_speculative_tokens=request.num_speculative_tokens,
                  structured_outputs=structured_outputs(request))
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        match = re.match(r"SamplingParams\.(\w+)", str(e))
        message = str(e).replace("SamplingParams.", "", 1) if match else str(e)
        raise ApiError(400, message, request.field_of(match.group(1)) if match else None) from None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs(request: BaseRequest) -> StructuredOutputsParams | None:
    """The request's output constraint from OpenAI's ``response_format`` (``json_object``, ``json_schema``)
    or vLLM's ``structured_outputs`` / ``guided_*`` fields (at most one of them); a bad one is a 400
    naming the field."""
    given = {name: getattr(request, name) for name in ("response_format", "structured_outputs", *_GUIDED)
             if getattr(request, name) not in (None, {"type": "text"})}
    if not given:
        return None
    if len(given) > 1:
        names = sorted(given)
        raise ApiError(400, f"{names[0]} and {names[1]}: give at most one output constraint", names[1])
    (name, value), = given.items()
    try:
        if name == "response_format":
            kind = value.get("type")
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind != "json_schema":
                raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("json_schema must be an object with a 'schema' object")
            return StructuredOutputsParams(json=spec.get("schema", {}))
        if name == "structured_outputs":
            unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(_STRUCTURED_KEYS)})")
            return StructuredOutputsParams(**{key: value[key] for key in _STRUCTURED_KEYS if key in value})
        return StructuredOutputsParams(**{_GUIDED[name]: value})
    except (ValueError, TypeError) as e:
        message = str(e).replace("SamplingParams.structured_outputs must be ", "must be ")
        raise ApiError(400, f"{name}: {message}", name) from None


def choice_params(request: BaseRequest, params: SamplingParams) -> list[SamplingParams]:
    """Each choice's ``SamplingParams`` (``n``): choice i seeded with seed + i, as vLLM does (a seed
    that would pass 2**63 - 1 is a 400 naming ``seed``); unseeded choices draw independent streams."""
    n, seed = request.num_choices(), params.seed
    if seed is not None and seed + n > MAX_SEED:
        raise ApiError(400, f"seed + n - 1 must be < 2**63 (choice i is seeded with seed + i), got seed {seed}, "
                            f"n {n}", "seed")
    return [params if seed is None or not i else dataclasses.replace(params, seed=seed + i) for i in range(n)]


def engine_refusal(request: BaseRequest, message: str) -> ApiError:
    """The 400 of a request the engine's ``add_request`` refused with ``message``, naming the field."""
    match = re.search(r"SamplingParams\.(\w+)", message)
    name = match.group(1) if match else "max_tokens" if "max_tokens" in message else "prompt"
    return ApiError(400, message, request.field_of(name))


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The 400 of pydantic's validation errors: the first one, naming its field."""
    if not errors:
        return ApiError(400, "invalid request body")
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(p for p in loc if not re.fullmatch(r"(str|int|list\[.*\]|dict\[.*\]|float|bool|none)", p))
    message = error.get("msg", "invalid value")
    if error.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', message)}")
    if error.get("type") == "extra_forbidden":
        return ApiError(400, f"{where}: unknown field", param, "unknown_parameter")
    if not loc:
        return ApiError(400, f"the request body must be a JSON object ({message})")
    return ApiError(400, f"{where}: {message}", param)
