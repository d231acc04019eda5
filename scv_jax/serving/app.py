"""The endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, in OpenAI's shapes.

Each request's ``n`` choices are submitted to the ``EngineLoop`` as n engine requests (choice i seeded
with seed + i; with the prefix cache they share the prompt's blocks) and their events read from asyncio
queues; a request is answered (or its stream started) once the engine took them, so that a request it
refuses is a 400, and a client that leaves aborts all of them. The response carries ``usage`` (the
prompt counted once, the choices' tokens summed; with a ``prediction``, ``completion_tokens_details``)
and, as extensions, ``spec_decode`` (the drafted and accepted token counts) and vLLM's per-request
``metrics`` object, ``{"speculative_decoding": {...}}`` (``_metrics``), both summed over the choices; a
stream sends ``metrics`` on its last chunk.

Bodies are read up to ``--max-request-bytes`` (413 beyond) and parsed by ``protocol.parse_request``;
prompts longer than ``--max-prompt-chars`` are a 400 before tokenizing, which runs on a worker thread
(the event loop keeps serving the other requests). A client that disconnects has its request aborted
at once. Every error, also FastAPI's own (404, 405), is OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from scv_jax.sampling_params import SamplingParams
from scv_jax.serving.chat import ChatTemplate, ChatTemplateError
from scv_jax.serving.detokenize import TextStream
from scv_jax.serving.engine_loop import Added, EngineFailed, EngineLoop, Output, Refused, Shutdown
from scv_jax.serving.metrics import ServerMetrics
from scv_jax.serving.protocol import (ApiError, BaseRequest, Body, ChatRequest, CompletionRequest, choice_params,
                                      engine_refusal, parse_request, sampling_params, stop_strings,
                                      structured_outputs, unknown_fields)
from scv_jax.serving.tools import ToolSet, decoder, template_parser, tool_set

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"    # with --allow-unknown-fields: the unknown fields ignored


@dataclasses.dataclass
class ServingContext:
    """What the endpoints need: the engine loop, the tokenizer (``encode`` / ``decode`` / ``vocab_size``),
    the chat template (None: the model has none), the served name, the context length, the most
    requests in flight (running + waiting) before a 429, the limits on a body's bytes and a prompt's
    characters, whether unknown request fields are ignored (else a 400), and the tool-call parser of
    ``tool_choice: "auto"`` (None: the chat template's, ``tools.template_parser``)."""

    engine_loop: EngineLoop
    tokenizer: Any
    chat_template: ChatTemplate | None
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    max_in_flight: int
    max_request_bytes: int
    max_prompt_chars: int
    allow_unknown_fields: bool = False
    tool_call_parser: str | None = None
    in_flight: int = 0
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class _Piece:
    """What a request's output adds: its text, the token ids it used and their logprobs."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple | None


class _Run:
    """One choice (``index``) of a request, an engine request: its events turned into text pieces, its end
    into usage and metrics."""

    def __init__(self, ctx: ServingContext, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                 body: BaseRequest):
        self.ctx, self.request_id, self.index, self.prompt, self.params, self.body = (ctx, request_id, index, prompt,
                                                                                     params, body)
        self.stream = TextStream(ctx.tokenizer.decode, prompt, stop_strings(body),
                                 include_stop=body.include_stop_str_in_output)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival, self.first_token_at, self.last_token_at = time.monotonic(), None, None
        self.num_tokens, self.finish_reason, self.done, self.admitted, self.closed = 0, None, False, False, False
        self.draft_tokens = self.accepted = self.drafts = self.cached_tokens = 0
        self.prediction_accepted = self.prediction_rejected = 0
        self.accepted_per_pos: tuple[int, ...] = ()

    def submit(self) -> None:
        """Hands the request to the engine loop (``added`` waits for its answer)."""
        loop = asyncio.get_running_loop()
        self.ctx.in_flight += 1
        self.ctx.engine_loop.submit(self.request_id, self.prompt, self.params,
                                    lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event))

    async def added(self) -> None:
        """Waits until the engine took the request; ApiError 400 when it refused it."""
        try:
            event = await self.queue.get()
        except BaseException:      # cancelled (the client left) before the engine answered
            self.close()
            raise
        self.admitted = isinstance(event, Added)
        if not self.admitted:
            self.done = True
            self.close()
            if isinstance(event, Refused):
                raise engine_refusal(self.body, event.message)
            raise ApiError(500, event.message) if isinstance(event, EngineFailed) else _shutting_down()

    async def pieces(self) -> AsyncIterator[_Piece]:
        """The output as it comes. Raises ApiError 500 when a step failed, 503 when the server stopped
        the request (shutting down)."""
        while not self.done:
            match await self.queue.get():
                case EngineFailed(message):
                    self.done, self.finish_reason = True, "error"
                    raise ApiError(500, message)
                case Shutdown():
                    self.done, self.finish_reason = True, "abort"
                    raise _shutting_down()
                case Output(output):
                    piece = self._output(output)
                    if piece.text or piece.token_ids or self.done:
                        yield piece

    def _output(self, output) -> _Piece:
        now = time.monotonic()
        new = output.new_token_ids
        # a stop token (eos, stop_token_ids) ends the output: counted, its text not emitted (as vLLM)
        stop_token = output.stop_token_id is not None and bool(new) and not self.body.include_stop_str_in_output
        update = self.stream.add(new[:-1] if stop_token else new)
        used = new if stop_token and not update.stopped else new[:update.num_tokens]
        if used:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        self.num_tokens += len(used)
        if output.num_draft_tokens > self.draft_tokens:
            self.drafts += 1
        self.draft_tokens, self.accepted = output.num_draft_tokens, output.num_accepted_tokens
        self.accepted_per_pos = tuple(output.num_accepted_per_pos)
        self.cached_tokens = output.num_cached_tokens
        self.prediction_accepted = output.num_accepted_prediction_tokens
        self.prediction_rejected = output.num_rejected_prediction_tokens
        text = update.text
        if update.stopped:
            self.done, self.finish_reason = True, "stop"
            if not output.finished:
                self.ctx.engine_loop.abort(self.request_id)
        elif output.finished:
            self.done, self.finish_reason = True, output.finish_reason
            text += self.stream.finish()
        logprobs = None if output.logprobs is None else tuple(output.logprobs[:len(used)])
        return _Piece(text, tuple(used), logprobs)

    def close(self) -> None:
        """Ends the request (aborting it in the engine when unfinished) and records its metrics; once."""
        if self.closed:
            return
        m, ctx, self.closed = self.ctx.metrics, self.ctx, True
        ctx.in_flight -= 1
        if not self.done:
            self.done, self.finish_reason = True, "abort"
            ctx.engine_loop.abort(self.request_id)
        if not self.admitted:      # refused by the engine (a 400): not a request it ran
            return
        m.labels(m.request_success, self.finish_reason or "error").inc()
        if self.index == 0:         # the prompt of n choices counts once
            m.labels(m.prompt_tokens).inc(len(self.prompt))
        m.labels(m.generation_tokens).inc(self.num_tokens)
        m.add_spec_decode(self.drafts, self.draft_tokens, self.accepted, self.accepted_per_pos)
        if self.first_token_at is not None:
            m.labels(m.ttft).observe(self.first_token_at - self.arrival)
            m.labels(m.e2e).observe(self.last_token_at - self.arrival)
            if self.num_tokens > 1:
                m.labels(m.tpot).observe((self.last_token_at - self.first_token_at) / (self.num_tokens - 1))


async def _start(jobs: list[_Run]) -> None:
    """Submits a request's choices at once (the engine admits them together) and waits until the engine
    took them all; when it refused one (a 400) or the client left, ends them all."""
    for job in jobs:
        job.submit()
    try:
        for job in jobs:
            await job.added()
    except BaseException:
        for job in jobs:
            job.close()
        raise


def _close(jobs: list[_Run]) -> None:
    for job in jobs:
        job.close()


async def _merged(jobs: list[_Run]) -> AsyncIterator[tuple[int, _Piece | None]]:
    """The choices' pieces as they come, as (index, piece), and (index, None) once a choice ended; raises
    the error of a choice that failed (ApiError: its step failed, or the server stops)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: _Run) -> None:
        try:
            async for piece in job.pieces():
                queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as error:     # noqa: BLE001 (raised where the pieces are read)
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(index, job)) for index, job in enumerate(jobs)]
    try:
        ended = 0
        while ended < len(jobs):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            ended += item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(jobs: list[_Run]) -> dict[str, Any]:
    """OpenAI's usage: the prompt counted once, the choices' tokens summed; ``prompt_tokens_details.cached_tokens``:
    the prompt tokens the first choice found in the prefix cache (its siblings' hits count in the prefix
    cache's metrics); with a prediction, ``completion_tokens_details``: the prediction's drafts accepted
    and rejected by verification, summed over the choices."""
    prompt, completion = len(jobs[0].prompt), sum(job.num_tokens for job in jobs)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": jobs[0].cached_tokens}}
    if jobs[0].params.prediction:
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(job.prediction_accepted for job in jobs),
            "rejected_prediction_tokens": sum(job.prediction_rejected for job in jobs)}
    return usage


def _spec_decode(jobs: list[_Run]) -> dict[str, int]:
    return {"num_draft_tokens": sum(job.draft_tokens for job in jobs),
            "num_accepted_tokens": sum(job.accepted for job in jobs)}


def _metrics(jobs: list[_Run]) -> dict[str, Any]:
    """vLLM's per-request ``metrics``: ``speculative_decoding``, the acceptance of the request's choices
    together under vLLM's field names (its summary level; ``acceptance_histogram_by_draft_length`` is left
    out), plus ``num_accepted_tokens_per_pos`` (the Prometheus counter's name); null when the engine does
    not draft. ``num_spec_tokens``: the most drafts a step may verify (the engine's most, capped by the
    request's ``num_speculative_tokens``); ``num_spec_steps``: the choices' steps that verified drafts."""
    if not any(job.accepted_per_pos for job in jobs):       # no drafter (or no step reported yet)
        return {"speculative_decoding": None}
    width = max(len(job.accepted_per_pos) for job in jobs)
    accepted_per_pos = [sum(job.accepted_per_pos[j] for job in jobs if j < len(job.accepted_per_pos))
                        for j in range(width)]
    cap = jobs[0].params.num_speculative_tokens
    k = width if cap is None else min(cap, width)
    per_pos, steps = accepted_per_pos[:k], sum(job.drafts for job in jobs)
    accepted, drafted = sum(job.accepted for job in jobs), sum(job.draft_tokens for job in jobs)
    reached = [steps, *per_pos, 0]        # steps that accepted at least j drafts, j = 0..k + 1
    return {"speculative_decoding": {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": [reached[j] - reached[j + 1] for j in range(k + 1)],
        "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted, "num_spec_tokens": k, "num_accepted_tokens_per_pos": per_pos}}


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: the request was aborted after the graceful-shutdown period")


def _token_text(tokenizer, token_id: int) -> str:
    """A token's text, or its vocabulary string when it is part of a character (its text alone would
    be U+FFFD, the same for many tokens)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return tokenizer.id_to_token(token_id) or text if "\ufffd" in text else text


def _completion_logprobs(tokenizer, logprobs, offset: int) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object of some tokens whose text starts at ``offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in logprobs:
        text = _token_text(tokenizer, entry.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append({_token_text(tokenizer, t): lp for t, lp in entry.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(tokenizer, logprobs) -> list[dict[str, Any]]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in logprobs]


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode("utf-8")


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


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (its body was read: what comes next is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _all_pieces(jobs: list[_Run]) -> list[list[_Piece]]:
    pieces: list[list[_Piece]] = [[] for _ in jobs]
    async for index, piece in _merged(jobs):
        if piece is not None:
            pieces[index].append(piece)
    return pieces


async def _whole(jobs: list[_Run], request: Request) -> list[list[_Piece]] | None:
    """The whole output of each choice, or None when the client disconnected first (the choices are then
    all aborted at once)."""
    collect, gone = asyncio.ensure_future(_all_pieces(jobs)), asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        collect.cancel()
        gone.cancel()
        _close(jobs)
    return collect.result() if collect in done else None


def build_app(ctx: ServingContext) -> FastAPI:
    """The FastAPI application serving ``ctx`` (its lifespan starts and stops the engine loop)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine_loop.start()
        yield
        ctx.engine_loop.stop(timeout=30)

    app = FastAPI(title="scv-jax", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        """A bug: OpenAI's 500 (Starlette then logs the traceback)."""
        return JSONResponse(ApiError(500, f"internal server error: {type(error).__name__}").body(), status_code=500)

    async def accept(request: Request, model: type[Body]) -> tuple[Body, dict[str, str]]:
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

    def check_chars(text: str, where: str) -> None:
        if len(text) > ctx.max_prompt_chars:
            raise ApiError(400, f"{where} has {len(text)} characters, more than this server's limit of "
                                f"{ctx.max_prompt_chars} (--max-prompt-chars)", where)

    def check_length(prompt: list[int], body: BaseRequest) -> int:
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

    def admit(n: int) -> None:
        """A 429 when the request's ``n`` choices do not fit the requests in flight now; a 400 naming ``n``
        when they never would."""
        if n > ctx.max_in_flight:
            raise ApiError(400, f"n {n} exceeds the {ctx.max_in_flight} requests this server holds in flight "
                                "(--max-num-seqs + --max-waiting)", "n")
        if ctx.in_flight + n > ctx.max_in_flight:
            raise ApiError(429, f"the server's queue is full ({ctx.in_flight} requests in flight); retry later")

    def encode(text: str) -> list[int]:
        """A bad word's tokens (no special tokens)."""
        return ctx.tokenizer.encode(text, add_special_tokens=False)

    async def prompt_ids(prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported (one per request)",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_chars(prompt, "prompt")
            return await asyncio.to_thread(ctx.tokenizer.encode, prompt)
        vocab = ctx.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside [0, vocab_size={vocab})", "prompt")
        return list(prompt)

    async def run(request: Request, body: BaseRequest, headers: dict[str, str], ids: list[int], params: SamplingParams,
                  tools: ToolSet | None = None, parser: str | None = None):
        vocab = ctx.tokenizer.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ApiError(400, f"stop_token_ids must be ids in [0, vocab_size={vocab}), got "
                                f"{list(params.stop_token_ids)}", "stop_token_ids")
        choices = choice_params(body, params)
        admit(len(choices))
        chat = isinstance(body, ChatRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        jobs = [_Run(ctx, request_id if len(choices) == 1 else f"{request_id}-{i}", i, ids, choice, body)
                for i, choice in enumerate(choices)]
        await _start(jobs)
        shape = _ChatShape(ctx, request_id, tools, parser) if chat else _CompletionShape(ctx, request_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # the background task closes a stream whose generator never ran (its client left at once)
            return StreamingResponse(_stream(jobs, shape, include_usage), media_type="text/event-stream",
                                     headers=headers, background=BackgroundTask(_close, jobs))
        pieces = await _whole(jobs, request)
        if pieces is None:      # nobody to answer
            return Response(status_code=499)
        return JSONResponse(shape.whole(jobs, pieces), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, headers = await accept(request, CompletionRequest)
        ids = await prompt_ids(body.prompt)
        params = sampling_params(body, check_length(ids, body), body.logprobs, encode)
        return await run(request, body, headers, ids, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, headers = await accept(request, ChatRequest)
        if ctx.chat_template is None:
            raise ApiError(400, f"the model `{ctx.model_name}` has no chat template (tokenizer_config.json's "
                                "chat_template): use /v1/completions", "messages")
        if not body.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        tools = tool_set(body)
        parser = tool_parser(body, tools)
        messages = []
        for i, message in enumerate(body.messages):
            fields = message.model_dump(exclude_none=True)
            if isinstance(message.content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in message.content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
                fields["content"] = "".join(p["text"] for p in message.content)
            messages.append(_with_call_arguments(fields))
        try:
            text = await asyncio.to_thread(ctx.chat_template.render, messages,
                                           add_generation_prompt=body.add_generation_prompt,
                                           tools=tools.template_tools() if tools else None)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        check_chars(text, "messages")
        ids = await asyncio.to_thread(ctx.tokenizer.encode, text, add_special_tokens=False)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling_params(body, check_length(ids, body), (body.top_logprobs or 0) if body.logprobs else None,
                                 encode)
        prediction = body.prediction_text()
        if prediction:
            check_chars(prediction, "prediction")
            params = dataclasses.replace(params, prediction=tuple(await asyncio.to_thread(encode, prediction)))
        if tools is not None and tools.forced:
            params = dataclasses.replace(params, structured_outputs=tools.constraint())
        return await run(request, body, headers, ids, params, tools, parser)

    def tool_parser(body: ChatRequest, tools: ToolSet | None) -> str | None:
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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "scv-jax", "max_model_len": ctx.max_model_len}]}

    @app.get("/health")
    async def health():
        alive = ctx.engine_loop.alive
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    return app


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


async def _stream(jobs: list[_Run], shape, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE stream of one request: a first chunk per choice, the choices' chunks as they come (each
    with its ``index``), a chunk with each choice's finish reason when it ends (the last of them with
    ``spec_decode``), with ``include_usage`` a last chunk with the usage (``choices: []``; the others have
    ``usage: null``), the last of them with ``metrics`` (vLLM sends it on its usage chunk), then ``[DONE]``;
    a failed step or a shutdown sends OpenAI's error object instead. A client that goes away cancels this
    generator, and ``close`` aborts every choice."""
    usage = {"usage": None} if include_usage else {}
    try:
        for index in range(len(jobs)):
            yield _sse({**shape.first_chunk(index), **usage})
        ended = 0
        async for index, piece in _merged(jobs):
            if piece is not None:
                if piece.text or piece.logprobs:
                    for chunk in shape.chunks(index, piece, None):
                        yield _sse({**chunk, **usage})
                continue
            ended += 1
            last = {"spec_decode": _spec_decode(jobs), **({} if include_usage else {"metrics": _metrics(jobs)})} \
                if ended == len(jobs) else {}
            chunks = shape.chunks(index, _Piece("", (), None), jobs[index].finish_reason)
            for chunk in chunks[:-1]:
                yield _sse({**chunk, **usage})
            yield _sse({**chunks[-1], **usage, **last})
        if include_usage:
            yield _sse({**shape.usage_chunk(_usage(jobs)), "metrics": _metrics(jobs)})
    except ApiError as error:
        yield _sse(error.body())
    finally:
        _close(jobs)
    yield _sse("[DONE]")


class _CompletionShape:
    """``/v1/completions``' response and chunks."""

    def __init__(self, ctx: ServingContext, request_id: str):
        self.ctx, self.id = ctx, request_id
        self.offsets: dict[int, int] = {}      # each choice's text so far (its logprobs' text_offset)

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": self.ctx.model_name}

    def first_chunk(self, index: int) -> dict[str, Any]:
        return self.chunk(index, _Piece("", (), None), None)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._base(), "choices": [], "usage": usage}

    def chunks(self, index: int, piece: _Piece, finish_reason: str | None) -> list[dict[str, Any]]:
        return [self.chunk(index, piece, finish_reason)]

    def chunk(self, index: int, piece: _Piece, finish_reason: str | None) -> dict[str, Any]:
        offset = self.offsets.get(index, 0)
        logprobs = None if piece.logprobs is None else _completion_logprobs(self.ctx.tokenizer, piece.logprobs, offset)
        self.offsets[index] = offset + len(piece.text)
        return {**self._base(), "choices": [{"index": index, "text": piece.text, "logprobs": logprobs,
                                             "finish_reason": finish_reason}]}

    def whole(self, jobs: list[_Run], pieces: list[list[_Piece]]) -> dict[str, Any]:
        def choice(job: _Run, pieces: list[_Piece]) -> dict[str, Any]:
            logprobs = [e for p in pieces for e in (p.logprobs or ())]
            return {"index": job.index, "text": "".join(p.text for p in pieces), "finish_reason": job.finish_reason,
                    "logprobs": _completion_logprobs(self.ctx.tokenizer, logprobs, 0)
                    if job.params.logprobs is not None else None}
        return {**self._base(), "choices": [choice(job, p) for job, p in zip(jobs, pieces)], "usage": _usage(jobs),
                "spec_decode": _spec_decode(jobs), "metrics": _metrics(jobs)}


class _ChatShape:
    """``/v1/chat/completions``' response and chunks; with ``tools``, each choice's text goes through its
    tool-call decoder (``tools.decoder``): ``message.tool_calls`` (legacy: ``function_call``) and
    finish_reason "tool_calls" ("function_call") when it made calls and stopped."""

    def __init__(self, ctx: ServingContext, request_id: str, tools: ToolSet | None = None, parser: str | None = None):
        self.ctx, self.id, self.tools, self.parser = ctx, request_id, tools, parser
        self.decoders: dict[int, Any] = {}
        self.called: set[int] = set()          # the choices that made a call

    def _base(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": int(time.time()), "model": self.ctx.model_name}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": usage}

    def first_chunk(self, index: int) -> dict[str, Any]:
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def _decoder(self, index: int) -> Any:
        if index not in self.decoders:
            self.decoders[index] = None if self.tools is None else decoder(self.tools, self.parser)
        return self.decoders[index]

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if reason == "stop" and index in self.called:
            return "function_call" if self.tools.legacy else "tool_calls"
        return reason

    def _call_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        """A tool call's delta as the chunk's ``delta`` (legacy: ``function_call``, without index and id)."""
        if self.tools.legacy:
            return {"function_call": delta["function"]}
        return {"tool_calls": [delta]}

    def chunks(self, index: int, piece: _Piece, finish_reason: str | None) -> list[dict[str, Any]]:
        """A piece's chunks: its content (and logprobs), its tool-call deltas, and with ``finish_reason`` a
        last chunk with it."""
        logprobs = None if piece.logprobs is None else {"content": _chat_logprobs(self.ctx.tokenizer, piece.logprobs)}
        calls = self._decoder(index)
        content, deltas = (piece.text, []) if calls is None else calls.feed(piece.text)
        if calls is not None and finish_reason is not None:
            more, last = calls.finish()
            content, deltas = content + more, deltas + last
        if deltas:
            self.called.add(index)
        out = [self._chunk(index, {"content": content} if content else {}, logprobs, None)] \
            if content or logprobs else []
        out += [self._chunk(index, self._call_delta(delta), None, None) for delta in deltas]
        if finish_reason is not None:
            out.append(self._chunk(index, {}, None, self._finish_reason(index, finish_reason)))
        return out

    def _message(self, index: int, text: str) -> dict[str, Any]:
        """A choice's whole message: its content, or its calls (a forced call only when its text is whole)."""
        calls = self._decoder(index)
        if calls is None:
            return {"role": "assistant", "content": text}
        content, deltas = calls.feed(text)
        more, last = calls.finish()
        content, deltas = content + more, deltas + last
        if self.tools.forced:
            try:
                json.loads(text)
            except ValueError:             # cut (max_tokens, a stop string): the text as it is
                return {"role": "assistant", "content": text}
        merged: dict[int, dict[str, Any]] = {}
        for delta in deltas:
            if delta["index"] in merged:
                merged[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
            else:
                merged[delta["index"]] = {"id": delta["id"], "type": delta["type"], "function": dict(delta["function"])}
        if not merged:
            return {"role": "assistant", "content": content}
        self.called.add(index)
        message = {"role": "assistant", "content": content or None}
        if self.tools.legacy:
            return {**message, "function_call": merged[0]["function"]}
        return {**message, "tool_calls": list(merged.values())}

    def whole(self, jobs: list[_Run], pieces: list[list[_Piece]]) -> dict[str, Any]:
        def choice(job: _Run, pieces: list[_Piece]) -> dict[str, Any]:
            logprobs = [e for p in pieces for e in (p.logprobs or ())]
            message = self._message(job.index, "".join(p.text for p in pieces))
            return {"index": job.index, "message": message,
                    "logprobs": {"content": _chat_logprobs(self.ctx.tokenizer, logprobs)}
                    if job.params.logprobs is not None else None,
                    "finish_reason": self._finish_reason(job.index, job.finish_reason)}
        return {**self._base("chat.completion"), "choices": [choice(job, p) for job, p in zip(jobs, pieces)],
                "usage": _usage(jobs), "spec_decode": _spec_decode(jobs), "metrics": _metrics(jobs)}
