"""``StepSummary``: what the host needs after a step, packed into one device array and fetched in one
transfer; ``HostStepResult`` is its unpacked host view."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class HostStepResult(NamedTuple):
    """A step's summary on the host, numpy arrays trimmed to the real batch.

    Attributes:
      output_token_ids: int32[B, K + 1], -1 after each request's last token.
      num_accepted: int32[B] accepted drafts; num_emitted: int32[B] tokens emitted per request;
      num_verified: int32[B] drafts the step verified per request (those after a stop token, or past a
        packed step's capacity, are never verified).
    """

    output_token_ids: np.ndarray
    num_accepted: np.ndarray
    num_emitted: np.ndarray
    num_verified: np.ndarray

    def token_lists(self) -> list[list[int]]:
        """Emitted tokens per request as Python lists (host-side, no device access)."""
        return [row[:n].tolist() for row, n in zip(self.output_token_ids, self.num_emitted)]


class StepSummary(NamedTuple):
    """A step's emitted tokens and accepted counts in one device array (a pytree).

    Attributes:
      packed: int32[B, K + 4]: the emitted tokens (-1 after the last), then the numbers of accepted
        drafts, of emitted tokens and of verified drafts.
    """

    packed: jax.Array

    @classmethod
    def pack(cls, output_token_ids: jax.Array, num_accepted: jax.Array, num_verified: jax.Array) -> "StepSummary":
        """On the device: int32[B, K + 1] tokens and int32[B] accepted and verified counts -> one array."""
        tokens = output_token_ids.astype(jnp.int32)
        emitted = jnp.sum(tokens >= 0, axis=1, dtype=jnp.int32)
        return cls(jnp.concatenate([tokens, num_accepted.astype(jnp.int32)[:, None], emitted[:, None],
                                    num_verified.astype(jnp.int32)[:, None]], axis=1))

    @staticmethod
    def unpack(packed: np.ndarray, num_requests: int | None = None) -> HostStepResult:
        """On the host: the fetched array -> ``HostStepResult`` of the first ``num_requests`` rows."""
        packed = np.asarray(packed)[:num_requests]
        return HostStepResult(packed[:, :-3], packed[:, -3], packed[:, -2], packed[:, -1])

    def fetch(self, num_requests: int | None = None) -> HostStepResult:
        """One device-to-host transfer, unpacked; trims padding rows past ``num_requests``."""
        return self.unpack(np.asarray(self.packed), num_requests)

    def start_fetch(self, num_requests: int | None = None) -> "PendingFetch":
        """Starts the transfer now (overlapping host work); ``.result()`` waits for it."""
        return PendingFetch(self, num_requests)


class PendingFetch:
    """A started device-to-host copy of a ``StepSummary``."""

    def __init__(self, summary: StepSummary, num_requests: int | None = None):
        self._summary, self._num_requests = summary, num_requests
        summary.packed.copy_to_host_async()

    def result(self) -> HostStepResult:
        return StepSummary.unpack(np.asarray(self._summary.packed), self._num_requests)


def _summary_of(output) -> StepSummary:
    return output if isinstance(output, StepSummary) else output.summary


def fetch_step_output(output, num_requests: int | None = None) -> HostStepResult:
    """``output.summary.fetch(num_requests)`` for a ``VerifyStepOutput`` (or a ``StepSummary``)."""
    return _summary_of(output).fetch(num_requests)


def start_fetch(output, num_requests: int | None = None) -> PendingFetch:
    """``output.summary.start_fetch(num_requests)`` for a ``VerifyStepOutput`` (or a ``StepSummary``)."""
    return _summary_of(output).start_fetch(num_requests)
