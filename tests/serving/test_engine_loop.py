"""``EngineLoop``'s typed events, on the fake engine: ``Added`` then ``Output`` until finished, ``Refused``
for a request ``add_request`` rejects, ``EngineFailed`` for the requests of a step that raised and
``Shutdown`` for what is unfinished when the loop stops, or submitted after."""

from __future__ import annotations

import queue

import pytest

from scv_jax.sampling_params import SamplingParams
from scv_jax.serving.engine_loop import Added, EngineFailed, EngineLoop, Output, Refused, Shutdown
from tests.serving.fake_engine import FakeEngine, expected_tokens

TIMEOUT = 30.0


class _FailingOnce(FakeEngine):
    """Its first step raises."""

    failed = False

    def step(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected fault")
        return super().step()


@pytest.fixture
def events():
    """(post, take): ``post`` is a request's callback, ``take()`` its next event (waiting for it)."""
    received: queue.Queue = queue.Queue()
    return received.put, lambda: received.get(timeout=TIMEOUT)


def _loop(engine: FakeEngine) -> EngineLoop:
    loop = EngineLoop(engine)
    loop.start()
    return loop


def test_a_request_is_added_then_output_until_finished(events):
    post, take = events
    loop = _loop(FakeEngine(max_num_seqs=2, max_seq_len=64, num_blocks=8))
    try:
        loop.submit("a", [1, 2, 3], SamplingParams(max_tokens=9), post)
        assert take() == Added()
        tokens, event = [], None
        while not (event and event.output.finished):
            event = take()
            assert isinstance(event, Output) and event.output.request_id == "a"
            tokens += event.output.new_token_ids
        assert tokens == expected_tokens([1, 2, 3], 9) and event.output.finish_reason == "length"
    finally:
        loop.stop(TIMEOUT)
    assert not loop.alive


def test_a_refused_request_gets_the_engines_message(events):
    post, take = events
    loop = _loop(FakeEngine(max_num_seqs=2, max_seq_len=16, num_blocks=8))
    try:
        loop.submit("long", [1, 2, 3], SamplingParams(max_tokens=20), post)
        event = take()
        assert isinstance(event, Refused) and "exceed max_seq_len 16" in event.message
    finally:
        loop.stop(TIMEOUT)


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(events):
    post, take = events
    loop = _loop(_FailingOnce(max_num_seqs=2, max_seq_len=64, num_blocks=8))
    try:
        loop.submit("a", [1], SamplingParams(max_tokens=4), post)
        assert take() == Added()
        event = take()
        assert event == EngineFailed("the engine step failed: RuntimeError: injected fault")
        loop.submit("c", [3], SamplingParams(max_tokens=1), post)
        assert take() == Added()
        event = take()
        assert isinstance(event, Output) and event.output.request_id == "c" and event.output.finished
    finally:
        loop.stop(TIMEOUT)


def test_stopping_shuts_down_the_unfinished_requests(events):
    post, take = events
    loop = _loop(FakeEngine(max_num_seqs=2, max_seq_len=4096, num_blocks=512, step_seconds=0.05))
    loop.submit("a", [1], SamplingParams(max_tokens=4000), post)
    assert take() == Added()
    loop.stop(TIMEOUT)
    while isinstance(event := take(), Output):
        assert not event.output.finished
    assert event == Shutdown() and not loop.alive


def test_a_request_submitted_after_the_stop_gets_shutdown(events):
    post, take = events
    loop = _loop(FakeEngine(max_num_seqs=2, max_seq_len=64, num_blocks=8))
    loop.stop(TIMEOUT)
    loop.submit("late", [1], SamplingParams(max_tokens=4), post)
    assert take() == Shutdown()
