"""A stand-in with ``scv_jax.Engine``'s interface that "decodes" a fixed text: the server's tests of
HTTP behaviour (queueing, faults, UTF-8 across tokens, stop strings across accepted runs) run on it in
milliseconds. Output token i of a prompt is byte ``CYCLE[(sum(prompt) + i) % len(CYCLE)]``; each step
emits an accepted run of 1 to DRAFTS + 1 tokens (``DRAFTS`` proposed, at most the request's
``num_speculative_tokens``), as a speculative step does."""

from __future__ import annotations

import collections
import dataclasses
import time

from scv_jax.decoding.outputs import RequestOutput, TokenLogprob  # the real engine's outputs
from scv_jax.decoding.stats import GenerateStats
from scv_jax.sampling_params import MAX_STOP_IDS

CYCLE = "héllo wörld € 𝄞 ".encode("utf-8")
DRAFTS = 3
BLOCK_SIZE = 16


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: object
    blocks: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    per_pos: list[int] = dataclasses.field(default_factory=lambda: [0] * DRAFTS)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake emits for ``prompt`` (no stop tokens): the reference of the tests. It starts at a
    character's first byte."""
    start = sum(prompt) % len(CYCLE)
    while CYCLE[start] & 0xC0 == 0x80:
        start += 1
    return [CYCLE[(start + i) % len(CYCLE)] for i in range(max_tokens)]


class _Compiled:
    """``Engine.start_warmup``'s compiler with nothing left to compile."""

    def stop(self) -> None:
        pass


class FakeEngine:
    def __init__(self, *, max_num_seqs: int, max_seq_len: int, num_blocks: int, eos_token_id=None,
                 step_seconds: float = 0.002):
        self.max_num_seqs, self.max_seq_len, self.num_blocks = max_num_seqs, max_seq_len, num_blocks
        self.eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
        self.step_seconds, self._steps, self._ids = step_seconds, 0, 0
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[str, _Request] = {}
        self._aborted: list[str] = []
        self.stats = GenerateStats()          # (num_preemptions: the fake never preempts)

    supports_logprobs = True
    supports_structured_output = False

    def warmup(self, max_num_seqs, max_len, *, temperatures=(0.0, 1.0), logprobs=False, structured_output=False,
               progress=False) -> int:
        return 0

    def start_warmup(self, max_num_seqs, max_len, *, temperatures=(0.0, 1.0), logprobs=False,
                     structured_output=False, progress=False) -> _Compiled:
        return _Compiled()

    def add_request(self, prompt_token_ids, params=None, request_id=None) -> str:
        from scv_jax.sampling_params import SamplingParams

        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt or not all(0 <= t < 256 for t in prompt):
            raise ValueError("Engine.add_request: prompt_token_ids must be a non-empty list of ids in [0, 256)")
        if len(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)) > MAX_STOP_IDS:
            raise ValueError(f"add_request: SamplingParams.stop_token_ids must hold ids in [0, vocab_size=256), "
                             f"at most {MAX_STOP_IDS} with the model's eos ids, got {params.stop_token_ids!r}")
        needed = len(prompt) + params.max_tokens
        if needed > self.max_seq_len:
            raise ValueError(f"Engine.add_request: prompt ({len(prompt)} tokens) + max_tokens {params.max_tokens} "
                             f"exceed max_seq_len {self.max_seq_len}")
        if request_id is None:
            self._ids += 1
            request_id = str(self._ids)
        self._waiting.append(_Request(request_id, prompt, params, -(-needed // BLOCK_SIZE)))
        return request_id

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - sum(r.blocks for r in self._running.values())

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting or self._aborted)

    def abort(self, request_id: str) -> None:
        if self._running.pop(request_id, None) is not None or any(r.request_id == request_id for r in self._waiting):
            self._waiting = collections.deque(r for r in self._waiting if r.request_id != request_id)
            self._aborted.append(request_id)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_seconds)
        while self._waiting and len(self._running) < self.max_num_seqs \
                and self._waiting[0].blocks <= self.num_free_blocks:
            request = self._waiting.popleft()
            self._running[request.request_id] = request
        outputs = [RequestOutput(rid, (), (), True, "abort", 0, 0, (0,) * DRAFTS, None) for rid in self._aborted]
        self._aborted = []
        self._steps += 1
        for request in list(self._running.values()):
            outputs.append(self._advance(request, 1 + self._steps % (DRAFTS + 1)))
        return outputs

    def _advance(self, request: _Request, count: int) -> RequestOutput:
        p = request.params
        drafts = DRAFTS if p.num_speculative_tokens is None else min(DRAFTS, p.num_speculative_tokens)
        count = min(count, drafts + 1)
        new, reason = [], None
        reference = expected_tokens(request.prompt, p.max_tokens)
        for token in reference[len(request.tokens):len(request.tokens) + count]:
            new.append(token)
            if token in p.stop_token_ids or (token in self.eos and not p.ignore_eos):
                reason = "stop"
                break
        request.tokens += new
        if reason is None and len(request.tokens) == p.max_tokens:
            reason = "length"
        request.drafted += drafts
        request.accepted += len(new) - 1
        for pos in range(len(new) - 1):
            request.per_pos[pos] += 1
        if reason is not None:
            del self._running[request.request_id]
        logprobs = None if p.logprobs is None else tuple(
            TokenLogprob(t, -0.25, tuple((t + j, -0.25 - j) for j in range(p.logprobs))) for t in new)
        return RequestOutput(request.request_id, tuple(new), tuple(request.tokens), reason is not None, reason,
                             request.drafted, request.accepted, tuple(request.per_pos), logprobs,
                             stop_token_id=new[-1] if reason == "stop" else None)
