"""OpenAI request bodies (with vLLM's extensions), their check and their ``SamplingParams``; errors in
OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from scv_jax.sampling_params import SamplingParams

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An HTTP error answered as OpenAI's error JSON; ``param``: the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code or self.status}}


class _Request(BaseModel):
    """Fields shared by both endpoints; strict types (a string is not a number, a bool not an int),
    unknown fields ignored (as vLLM)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def _unsupported(request: _Request) -> None:
    """400 for fields whose non-default values this server does not implement."""
    if request.n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {request.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (only 0), got {value}", name)
    if request.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if request.best_of not in (None, 1):
            raise ApiError(400, f"best_of must be 1, got {request.best_of}", "best_of")
        if request.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")


def stop_strings(request: _Request) -> tuple[str, ...]:
    stop = request.stop
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def sampling_params(request: _Request, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The request's ``SamplingParams`` (OpenAI's defaults: temperature 1, top_p 1); a bad value is a 400
    naming the request's field."""
    _unsupported(request)
    fields = dict(temperature=1.0 if request.temperature is None else request.temperature,
                  top_p=1.0 if request.top_p is None else request.top_p,
                  top_k=0 if request.top_k is None else request.top_k,
                  min_p=0.0 if request.min_p is None else request.min_p,
                  seed=request.seed, max_tokens=max_tokens, stop_token_ids=tuple(request.stop_token_ids or ()),
                  ignore_eos=request.ignore_eos, logprobs=logprobs)
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        match = re.match(r"SamplingParams\.(\w+)", str(e))
        name = match.group(1) if match else None
        if name == "logprobs" and isinstance(request, ChatRequest):
            name = "top_logprobs"
        message = str(e).replace("SamplingParams.", "", 1) if match else str(e)
        raise ApiError(400, message, name) from None


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The 400 of FastAPI's body validation errors: the first one, naming its field."""
    if not errors:
        return ApiError(400, "invalid request body")
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(p for p in loc if not re.fullmatch(r"(str|int|list\[.*\]|dict\[.*\]|float|bool|none)", p))
    message = error.get("msg", "invalid value")
    if error.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {message}")
    return ApiError(400, f"{where}: {message}" if where else message, param)
