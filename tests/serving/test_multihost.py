"""``scv-jax serve`` as one job of 2 processes x 4 CPU devices (``--mesh 2,4``, gloo collectives, traffic on
127.0.0.1 only): concurrent and streamed greedy completions equal offline one-device decoding (one with
penalties, one under a regex too), seeded sampling repeats, SIGTERM to process 0 ends both with status 0;
a follower killed mid-stream ends the stream with an error and the leader within 60 s; a follower started
with another --dtype is refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.serving.conftest import REQUEST_TIMEOUT, client
from tests.serving.harness import ROOT, STOP_TIMEOUT, ServerProcess, free_port

NAME = "tiny"
MAX_LEN = 64
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def __init__(self"]
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _flags(checkpoint, port: int, process_id: int, dtype: str = "float32", draft: bool = True) -> list[str]:
    """``serve``'s flags for process ``process_id``; ``draft``: the checkpoint drafts for itself (k = 2), else
    no drafter (fewer, cheaper steps to compile)."""
    return ["--model", str(checkpoint), *(["--draft", str(checkpoint), "--k", "2"] if draft else []),
            "--served-model-name", NAME, "--dtype", dtype, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "2",
            "--mesh", "2,4", "--num-processes", "2", "--process-id", str(process_id),
            "--coordinator-address", f"127.0.0.1:{port}", "--heartbeat-timeout", "10"]


def _follower(checkpoint, port: int, log, dtype: str = "float32", draft: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.serving.launch", "--", "serve", "--host", "127.0.0.1",
                             "--port", "0", *_flags(checkpoint, port, 1, dtype, draft)], cwd=ROOT, stdout=log,
                            stderr=log,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **ENV})


def _job(checkpoint, log_dir, draft: bool = True):
    """(leader ServerProcess, follower Popen) of one job."""
    port = free_port()
    follower_log = open(log_dir / "follower.log", "w")
    follower = _follower(checkpoint, port, follower_log, draft=draft)
    try:
        leader = ServerProcess(_flags(checkpoint, port, 0, draft=draft), log_dir / "leader.log", env=ENV)
    except BaseException:
        follower.kill()
        raise
    return leader, follower


def _offline(checkpoint, prompts: list[list[int]], max_tokens: int, **controls: float) -> list[list[int]]:
    """Greedy one-device tokens, with ``controls`` (``SamplingParams`` fields) for every prompt if given."""
    import scv_jax
    from scv_jax.models import load_hf

    decoder = scv_jax.SpeculativeDecoder(load_hf(checkpoint, dtype="float32"), None, config=scv_jax.DecoderConfig(
        k=0, max_seq_len=MAX_LEN, num_blocks=64, batch_buckets=(4,)))
    sampling = [scv_jax.SamplingParams(max_tokens=max_tokens, **controls)] * len(prompts)
    return decoder.generate(prompts, sampling=sampling).tokens


def _offline_constrained(checkpoint, tokenizer, prompt: str, regex: str, max_tokens: int) -> str:
    """The one-device greedy text of ``prompt`` under ``regex`` (an engine with the tokenizer)."""
    import scv_jax
    from scv_jax.models import load_hf

    engine = scv_jax.Engine(load_hf(checkpoint, dtype="float32"), None, tokenizer=tokenizer,
                            config=scv_jax.DecoderConfig(k=0, max_seq_len=MAX_LEN, num_blocks=64, batch_buckets=(4,)))
    engine.add_request(tokenizer.encode(prompt), scv_jax.SamplingParams(
        max_tokens=max_tokens, structured_outputs=scv_jax.StructuredOutputsParams(regex=regex)), "r")
    tokens: list[int] = []
    for _ in range(4 * max_tokens):
        if not engine.has_unfinished():
            break
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokenizer.decode(tokens)


@pytest.mark.slow
def test_two_processes_serve_as_one_device(checkpoint, tokenizer, tmp_path):
    leader, follower = _job(checkpoint, tmp_path)
    try:
        c = client(leader.url)
        expected = [tokenizer.decode(t) for t in _offline(checkpoint, [tokenizer.encode(p) for p in PROMPTS], 24)]
        texts: list = [None] * len(PROMPTS)

        def run(i: int) -> None:          # concurrent: streamed and not
            kwargs = dict(model=NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0)
            texts[i] = ("".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kwargs)) if i % 2
                        else c.completions.create(**kwargs).choices[0].text)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * REQUEST_TIMEOUT)
        assert texts == expected
        sampled = [c.completions.create(model=NAME, prompt="def main(", max_tokens=16, temperature=1.0, seed=3)
                   .choices[0].text for _ in range(2)]
        assert sampled[0] == sampled[1]
        penalties = dict(presence_penalty=1.5, frequency_penalty=0.5)     # the controls over two processes
        penalised = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, **penalties)
        assert penalised.choices[0].text == tokenizer.decode(
            _offline(checkpoint, [tokenizer.encode(PROMPTS[0])], 24, **penalties)[0]) != expected[0]
        regex = "[0-9]{3}-[a-z]{2}"      # structured output: drafted along its automaton on both processes
        constrained = c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                           extra_body={"guided_regex": regex}).choices[0].text
        assert re.fullmatch(regex, constrained), constrained
        assert constrained == _offline_constrained(checkpoint, tokenizer, PROMPTS[1], regex, 24)
        assert leader.stop(signal.SIGTERM) == 0, leader.stderr()
        assert follower.wait(STOP_TIMEOUT) == 0, (tmp_path / "follower.log").read_text()
    finally:
        follower.kill()
        leader.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_follower_ends_the_stream_with_an_error_and_the_leader(checkpoint, tmp_path):
    leader, follower = _job(checkpoint, tmp_path, draft=False)
    try:
        stream = client(leader.url).completions.create(model=NAME, prompt="def main(", max_tokens=MAX_LEN - 16,
                                                       temperature=0, stream=True)
        first = next(iter(stream))
        assert first.choices[0].text is not None
        follower.kill()
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert leader.wait() == 1 and time.monotonic() - started < 60, leader.stderr()
        assert "of the job stopped" in leader.stderr()
    finally:
        follower.kill()
        leader.stop(signal.SIGKILL)


def test_a_follower_with_other_flags_is_refused(checkpoint, tmp_path):
    port = free_port()
    with open(tmp_path / "follower.log", "w") as log:
        follower = _follower(checkpoint, port, log, dtype="bfloat16")
        leader = subprocess.run([sys.executable, "-m", "scv_jax", "serve", "--port", "0",
                                 *_flags(checkpoint, port, 0)], cwd=ROOT, capture_output=True, text=True,
                                timeout=STOP_TIMEOUT, env={**os.environ, "JAX_PLATFORMS": "cpu", **ENV})
        assert follower.wait(STOP_TIMEOUT) == 2
    message = "--dtype: process 0 has 'float32', process 1 has 'bfloat16'"
    assert leader.returncode == 2 and message in leader.stderr.splitlines()[-1], leader.stderr[-2000:]
    assert "--dtype: process 1 has 'bfloat16', process 0 has 'float32'" in (tmp_path / "follower.log").read_text()
