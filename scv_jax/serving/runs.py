"""A request's choices on the engine: each choice a ``Run``, an engine request whose events become text
``Piece``s and whose end becomes the server's metrics; ``start_all`` submits a request's choices
together, ``merged`` reads their pieces as they come, ``close_all`` ends them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, AsyncIterator

from scv_jax.sampling_params import SamplingParams
from scv_jax.serving.context import ServingContext
from scv_jax.serving.detokenize import TextStream
from scv_jax.serving.engine_loop import Added, EngineFailed, Output, Refused, Shutdown
from scv_jax.serving.protocol import ApiError, BaseRequest, engine_refusal, stop_strings

if TYPE_CHECKING:
    from scv_jax.decoding.outputs import RequestOutput


@dataclasses.dataclass
class Piece:
    """What a request's output adds: its text, the token ids it used and their logprobs."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple | None


class Run:
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

    async def pieces(self) -> AsyncIterator[Piece]:
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

    def _output(self, output: RequestOutput) -> Piece:
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
        return Piece(text, tuple(used), logprobs)

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


def close_all(jobs: list[Run]) -> None:
    """Ends each of a request's choices (``Run.close``)."""
    for job in jobs:
        job.close()


async def start_all(jobs: list[Run]) -> None:
    """Submits a request's choices at once (the engine admits them together) and waits until the engine
    took them all; when it refused one (a 400) or the client left, ends them all."""
    for job in jobs:
        job.submit()
    try:
        for job in jobs:
            await job.added()
    except BaseException:
        close_all(jobs)
        raise


async def merged(jobs: list[Run]) -> AsyncIterator[tuple[int, Piece | None]]:
    """The choices' pieces as they come, as (index, piece), and (index, None) once a choice ended; raises
    the error of a choice that failed (ApiError: its step failed, or the server stops)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: Run) -> None:
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


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: the request was aborted after the graceful-shutdown period")
