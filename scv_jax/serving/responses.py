"""OpenAI's responses to a request's choices: ``CompletionShape`` (``/v1/completions``) and ``ChatShape``
(``/v1/chat/completions``, with tool calls) shape the whole response or its chunks, with their logprobs,
``usage`` and the extensions ``spec_decode`` and ``metrics`` (vLLM's per-request object); ``stream``
sends a streamed request's chunks as server-sent events."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable

from scv_jax.serving.context import ServingContext
from scv_jax.serving.protocol import ApiError
from scv_jax.serving.runs import Piece, Run, close_all, merged
from scv_jax.serving.tools import ToolSet, decoder

if TYPE_CHECKING:
    from scv_jax.decoding.outputs import TokenLogprob


def _usage(jobs: list[Run]) -> dict[str, Any]:
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


def _spec_decode(jobs: list[Run]) -> dict[str, int]:
    return {"num_draft_tokens": sum(job.draft_tokens for job in jobs),
            "num_accepted_tokens": sum(job.accepted for job in jobs)}


def _metrics(jobs: list[Run]) -> dict[str, Any]:
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


def _token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text, or its vocabulary string when it is part of a character (its text alone would
    be U+FFFD, the same for many tokens)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return tokenizer.id_to_token(token_id) or text if "\ufffd" in text else text


def _completion_logprobs(tokenizer: Any, logprobs: Iterable[TokenLogprob], offset: int) -> dict[str, Any]:
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


def _chat_logprobs(tokenizer: Any, logprobs: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in logprobs]


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode("utf-8")


class CompletionShape:
    """``/v1/completions``' response and chunks."""

    def __init__(self, ctx: ServingContext, request_id: str):
        self.ctx, self.id = ctx, request_id
        self.offsets: dict[int, int] = {}      # each choice's text so far (its logprobs' text_offset)

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": self.ctx.model_name}

    def first_chunk(self, index: int) -> dict[str, Any]:
        return self.chunk(index, Piece("", (), None), None)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._base(), "choices": [], "usage": usage}

    def chunks(self, index: int, piece: Piece, finish_reason: str | None) -> list[dict[str, Any]]:
        return [self.chunk(index, piece, finish_reason)]

    def chunk(self, index: int, piece: Piece, finish_reason: str | None) -> dict[str, Any]:
        offset = self.offsets.get(index, 0)
        logprobs = None if piece.logprobs is None else _completion_logprobs(self.ctx.tokenizer, piece.logprobs, offset)
        self.offsets[index] = offset + len(piece.text)
        return {**self._base(), "choices": [{"index": index, "text": piece.text, "logprobs": logprobs,
                                             "finish_reason": finish_reason}]}

    def whole(self, jobs: list[Run], pieces: list[list[Piece]]) -> dict[str, Any]:
        def choice(job: Run, pieces: list[Piece]) -> dict[str, Any]:
            logprobs = [e for p in pieces for e in (p.logprobs or ())]
            return {"index": job.index, "text": "".join(p.text for p in pieces), "finish_reason": job.finish_reason,
                    "logprobs": _completion_logprobs(self.ctx.tokenizer, logprobs, 0)
                    if job.params.logprobs is not None else None}
        return {**self._base(), "choices": [choice(job, p) for job, p in zip(jobs, pieces)], "usage": _usage(jobs),
                "spec_decode": _spec_decode(jobs), "metrics": _metrics(jobs)}


class ChatShape:
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

    def chunks(self, index: int, piece: Piece, finish_reason: str | None) -> list[dict[str, Any]]:
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

    def whole(self, jobs: list[Run], pieces: list[list[Piece]]) -> dict[str, Any]:
        def choice(job: Run, pieces: list[Piece]) -> dict[str, Any]:
            logprobs = [e for p in pieces for e in (p.logprobs or ())]
            message = self._message(job.index, "".join(p.text for p in pieces))
            return {"index": job.index, "message": message,
                    "logprobs": {"content": _chat_logprobs(self.ctx.tokenizer, logprobs)}
                    if job.params.logprobs is not None else None,
                    "finish_reason": self._finish_reason(job.index, job.finish_reason)}
        return {**self._base("chat.completion"), "choices": [choice(job, p) for job, p in zip(jobs, pieces)],
                "usage": _usage(jobs), "spec_decode": _spec_decode(jobs), "metrics": _metrics(jobs)}


Shape = CompletionShape | ChatShape


async def stream(jobs: list[Run], shape: Shape, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE stream of one request: a first chunk per choice, the choices' chunks as they come (each
    with its ``index``), a chunk with each choice's finish reason when it ends (the last of them with
    ``spec_decode``), with ``include_usage`` a last chunk with the usage (``choices: []``; the others have
    ``usage: null``), the last of them with ``metrics`` (vLLM sends it on its usage chunk), then ``[DONE]``;
    a failed step or a shutdown sends OpenAI's error object instead. A client that goes away cancels this
    generator, and ``close_all`` aborts every choice."""
    usage = {"usage": None} if include_usage else {}
    try:
        for index in range(len(jobs)):
            yield _sse({**shape.first_chunk(index), **usage})
        ended = 0
        async for index, piece in merged(jobs):
            if piece is not None:
                if piece.text or piece.logprobs:
                    for chunk in shape.chunks(index, piece, None):
                        yield _sse({**chunk, **usage})
                continue
            ended += 1
            last = {"spec_decode": _spec_decode(jobs), **({} if include_usage else {"metrics": _metrics(jobs)})} \
                if ended == len(jobs) else {}
            chunks = shape.chunks(index, Piece("", (), None), jobs[index].finish_reason)
            for chunk in chunks[:-1]:
                yield _sse({**chunk, **usage})
            yield _sse({**chunks[-1], **usage, **last})
        if include_usage:
            yield _sse({**shape.usage_chunk(_usage(jobs)), "metrics": _metrics(jobs)})
    except ApiError as error:
        yield _sse(error.body())
    finally:
        close_all(jobs)
    yield _sse("[DONE]")
