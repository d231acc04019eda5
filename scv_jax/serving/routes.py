"""The endpoints, on ``router``: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
server-sent events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, in OpenAI's shapes;
each reaches the app's ``ServingContext`` through ``serving``. (They have comments, not docstrings,
which FastAPI would publish in ``/openapi.json``.)

Each request's ``n`` choices are submitted to the ``EngineLoop`` as n engine requests (choice i seeded
with seed + i; with the prefix cache they share the prompt's blocks) and their events read from asyncio
queues (``runs``); a request is answered (or its stream started) once the engine took them, so that a
request it refuses is a 400, and a client that leaves aborts all of them. The response (``responses``)
carries ``usage`` (the prompt counted once, the choices' tokens summed; with a ``prediction``,
``completion_tokens_details``) and, as extensions, ``spec_decode`` (the drafted and accepted token
counts) and vLLM's per-request ``metrics`` object, ``{"speculative_decoding": {...}}``, both summed over
the choices; a stream sends ``metrics`` on its last chunk.

Bodies are read up to ``--max-request-bytes`` (413 beyond) and parsed by ``protocol.parse_request``;
prompts longer than ``--max-prompt-chars`` are a 400 before tokenizing, which runs on a worker thread
(the event loop keeps serving the other requests). A client that disconnects has its request aborted
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import sys
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from scv_jax.sampling_params import SamplingParams
from scv_jax.serving.chat import ChatTemplateError
from scv_jax.serving.context import ServingContext
from scv_jax.serving.protocol import (ApiError, BaseRequest, Body, ChatMessage, ChatRequest, CompletionRequest,
                                      choice_params, parse_request, sampling_params, structured_outputs, unknown_fields)
from scv_jax.serving.responses import ChatShape, CompletionShape, stream
from scv_jax.serving.runs import Piece, Run, close_all, merged, start_all
from scv_jax.serving.tools import ToolSet, template_parser, tool_set

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"    # with --allow-unknown-fields: the unknown fields ignored

router = APIRouter()


def serving(request: Request) -> ServingContext:
    """The context of the app serving ``request`` (``build_app`` keeps it on ``app.state.serving``)."""
    return request.app.state.serving


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    # a completion of ``prompt`` (a string, or token ids)
    ctx = serving(request)
    body, headers = await _accept(ctx, request, CompletionRequest)
    ids = await _prompt_ids(ctx, body.prompt)
    params = sampling_params(body, _check_length(ctx, ids, body), body.logprobs, functools.partial(_encode, ctx))
    return await _run(ctx, request, body, headers, ids, params)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    # the assistant's answer to ``messages``, through the model's chat template; with ``tools``, its calls
    ctx = serving(request)
    body, headers = await _accept(ctx, request, ChatRequest)
    if ctx.chat_template is None:
        raise ApiError(400, f"the model `{ctx.model_name}` has no chat template (tokenizer_config.json's "
                            "chat_template): use /v1/completions", "messages")
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    tools = tool_set(body)
    parser = _tool_parser(ctx, body, tools)
    ids = await _chat_prompt(ctx, body, tools)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    params = sampling_params(body, _check_length(ctx, ids, body), (body.top_logprobs or 0) if body.logprobs else None,
                             functools.partial(_encode, ctx))
    prediction = body.prediction_text()
    if prediction:
        _check_chars(ctx, prediction, "prediction")
        params = dataclasses.replace(params, prediction=tuple(await asyncio.to_thread(_encode, ctx, prediction)))
    if tools is not None and tools.forced:
        params = dataclasses.replace(params, structured_outputs=tools.constraint())
    return await _run(ctx, request, body, headers, ids, params, tools, parser)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    # the one model served
    ctx = serving(request)
    return JSONResponse({"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                                     "owned_by": "scv-jax", "max_model_len": ctx.max_model_len}]})


@router.get("/health")
async def health(request: Request) -> Response:
    # 200 while the engine loop runs, else 503
    alive = serving(request).engine_loop.alive
    return Response(status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # the Prometheus metrics
    body, content_type = serving(request).metrics.render()
    return Response(body, media_type=content_type)


async def _accept(ctx: ServingContext, request: Request, model: type[Body]) -> tuple[Body, dict[str, str]]:
    """The request's body, parsed and checked, and the response's headers (the unknown fields ignored
    with --allow-unknown-fields, also logged on stderr)."""
    body = parse_request(await _read_body(request, ctx.max_request_bytes), request.headers.get("content-type"),
                         model)
    unknown = unknown_fields(body)
    if unknown and not ctx.allow_unknown_fields:
        raise ApiError(400, f"Unknown parameter: '{unknown[0]}' (neither OpenAI nor vLLM defines it; "
                            "scv-jax serve --allow-unknown-fields ignores such fields)", unknown[0],
                       "unknown_parameter")
    if body.model is not None and body.model != ctx.model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{ctx.model_name}`)",
                       "model", "model_not_found")
    if not unknown:
        return body, {}
    print(f"scv-jax serve: warning: ignored unknown request fields {', '.join(unknown)} ({request.url.path})",
          file=sys.stderr, flush=True)
    return body, {IGNORED_FIELDS_HEADER: ",".join(unknown)}


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body; ApiError 413 once it exceeds ``limit`` bytes (by its Content-Length, or as
    it arrives), before reading the rest."""
    too_large = ApiError(413, f"the request body exceeds this server's limit of {limit} bytes (--max-request-bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the request body") from None
    return b"".join(chunks)


def _check_chars(ctx: ServingContext, text: str, where: str) -> None:
    """A 400 naming ``where`` when ``text`` is longer than ``--max-prompt-chars``."""
    if len(text) > ctx.max_prompt_chars:
        raise ApiError(400, f"{where} has {len(text)} characters, more than this server's limit of "
                            f"{ctx.max_prompt_chars} (--max-prompt-chars)", where)


def _check_length(ctx: ServingContext, prompt: list[int], body: BaseRequest) -> int:
    """The output's length limit (the request's, or the rest of the context), checked against the
    context length."""
    where, max_tokens = body.PROMPT_FIELD, body.max_new_tokens()
    if not prompt:
        raise ApiError(400, f"{where} must not be empty (it encodes to no tokens)", where)
    room = ctx.max_model_len - len(prompt)
    if room < 1:
        raise ApiError(400, f"{where} has {len(prompt)} tokens, the model's context is {ctx.max_model_len} "
                            f"tokens (at least one must be left to generate)", where)
    if max_tokens is None:
        return room
    if max_tokens > room:
        field = body.max_tokens_field()
        raise ApiError(400, f"{field} {max_tokens} + the {len(prompt)} tokens of {where} exceed the model's "
                            f"context of {ctx.max_model_len} tokens", field)
    return max_tokens


def _admit(ctx: ServingContext, n: int) -> None:
    """A 429 when the request's ``n`` choices do not fit the requests in flight now; a 400 naming ``n``
    when they never would."""
    if n > ctx.max_in_flight:
        raise ApiError(400, f"n {n} exceeds the {ctx.max_in_flight} requests this server holds in flight "
                            "(--max-num-seqs + --max-waiting)", "n")
    if ctx.in_flight + n > ctx.max_in_flight:
        raise ApiError(429, f"the server's queue is full ({ctx.in_flight} requests in flight); retry later")


def _encode(ctx: ServingContext, text: str) -> list[int]:
    """A text's tokens without special tokens (a bad word, a prediction, a rendered chat)."""
    return ctx.tokenizer.encode(text, add_special_tokens=False)


async def _prompt_ids(ctx: ServingContext, prompt: Any) -> list[int]:
    """``/v1/completions``' prompt as token ids: a string tokenized on a worker thread, or ids checked
    against the vocabulary; a batch of one prompt as that prompt."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported (one per request)",
                           "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_chars(ctx, prompt, "prompt")
        return await asyncio.to_thread(ctx.tokenizer.encode, prompt)
    vocab = ctx.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt: token id {bad[0]} is outside [0, vocab_size={vocab})", "prompt")
    return list(prompt)


async def _chat_prompt(ctx: ServingContext, body: ChatRequest, tools: ToolSet | None) -> list[int]:
    """The chat's prompt: its messages rendered by the chat template (a 400 when that fails) and
    tokenized, both on a worker thread."""
    messages = [_template_message(i, message) for i, message in enumerate(body.messages)]
    try:
        text = await asyncio.to_thread(ctx.chat_template.render, messages,
                                       add_generation_prompt=body.add_generation_prompt,
                                       tools=tools.template_tools() if tools else None)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), "messages") from None
    _check_chars(ctx, text, "messages")
    return await asyncio.to_thread(_encode, ctx, text)


def _template_message(i: int, message: ChatMessage) -> dict[str, Any]:
    """``messages[i]`` as the chat template takes it: its content's text parts joined (a 400 for other
    parts), its tool calls' arguments parsed (``_with_call_arguments``)."""
    fields = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in message.content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        fields["content"] = "".join(p["text"] for p in message.content)
    return _with_call_arguments(fields)


def _with_call_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` with their JSON ``arguments`` text as objects (what chat
    templates expect, as vLLM passes them); other messages as they are."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message

    def parsed(call: Any) -> Any:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):
                return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        return call
    return {**message, "tool_calls": [parsed(call) for call in calls]}


def _tool_parser(ctx: ServingContext, body: ChatRequest, tools: ToolSet | None) -> str | None:
    """The parser of ``tool_choice: "auto"`` (``--tool-call-parser``, else the chat template's); a 400
    naming the choice's field when there is none, or when a forced call meets another output
    constraint."""
    if tools is None:
        return None
    if tools.forced and structured_outputs(body) is not None:
        raise ApiError(400, f"{tools.choice_field} {json.dumps(getattr(body, tools.choice_field))} constrains the "
                            f"output to a call: it cannot be combined with {body.field_of('structured_outputs')}",
                       tools.choice_field)
    parser = ctx.tool_call_parser or template_parser(ctx.chat_template.source)
    if tools.choice == "auto" and parser is None:
        forced = "a named function" if tools.legacy else '"required" or a named function'
        raise ApiError(400, f'{tools.choice_field} "auto" needs the model\'s tool-call format, and its chat '
                            "template has none this server knows (<tool_call> blocks, Llama 3's <|python_tag|>): "
                            f'send "none" or {forced}, or start the server with --tool-call-parser',
                       tools.choice_field)
    return parser


async def _run(ctx: ServingContext, request: Request, body: BaseRequest, headers: dict[str, str], ids: list[int],
               params: SamplingParams, tools: ToolSet | None = None, parser: str | None = None) -> Response:
    """Runs the request's choices on the engine and answers: a stream once the engine took them, or the
    whole response (499 when the client left first)."""
    vocab = ctx.tokenizer.vocab_size
    if any(t >= vocab for t in params.stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be ids in [0, vocab_size={vocab}), got "
                            f"{list(params.stop_token_ids)}", "stop_token_ids")
    choices = choice_params(body, params)
    _admit(ctx, len(choices))
    chat = isinstance(body, ChatRequest)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    jobs = [Run(ctx, request_id if len(choices) == 1 else f"{request_id}-{i}", i, ids, choice, body)
            for i, choice in enumerate(choices)]
    await start_all(jobs)
    shape = ChatShape(ctx, request_id, tools, parser) if chat else CompletionShape(ctx, request_id)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # the background task closes a stream whose generator never ran (its client left at once)
        return StreamingResponse(stream(jobs, shape, include_usage), media_type="text/event-stream",
                                 headers=headers, background=BackgroundTask(close_all, jobs))
    pieces = await _whole(jobs, request)
    if pieces is None:      # nobody to answer
        return Response(status_code=499)
    return JSONResponse(shape.whole(jobs, pieces), headers=headers)


async def _whole(jobs: list[Run], request: Request) -> list[list[Piece]] | None:
    """The whole output of each choice, or None when the client disconnected first (the choices are then
    all aborted at once)."""
    collect, gone = asyncio.ensure_future(_all_pieces(jobs)), asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        collect.cancel()
        gone.cancel()
        close_all(jobs)
    return collect.result() if collect in done else None


async def _all_pieces(jobs: list[Run]) -> list[list[Piece]]:
    """Each choice's pieces, once all of them ended."""
    pieces: list[list[Piece]] = [[] for _ in jobs]
    async for index, piece in merged(jobs):
        if piece is not None:
            pieces[index].append(piece)
    return pieces


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (its body was read: what comes next is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
