"""``scv-jax serve`` with its warm-up, on the real ``Engine`` (the tiny checkpoint drafting for itself,
no persistent cache): it listens once the steps that can run every other one are compiled, the rest
compiling in the background; requests of every kind meanwhile (greedy, sampled, with logprobs, two at
once) are answered with a fully compiled engine's tokens and compile nothing on the engine thread; a
SIGTERM while the background compiles go on exits 0 (the compile in progress ends, the queue is
dropped)."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from tests.serving.conftest import REQUEST_TIMEOUT, client
from tests.serving.harness import ServerProcess
from tests.serving.test_server_engine import offline  # noqa: F401 (a fixture: the target's greedy tokens)

NAME = "tiny"
MAX_LEN = 64
PROMPTS = ["def main(", "import os\n"]


@pytest.mark.slow
def test_serve_answers_every_kind_of_request_while_compiling_in_the_background(checkpoint, tokenizer, offline,
                                                                              tmp_path):
    process = ServerProcess(["--model", str(checkpoint), "--draft", str(checkpoint), "--k", "2",
                             "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                             "--max-num-seqs", "2"], tmp_path / "startup.log", env={"SCV_JAX_CACHE_DIR": "off"})
    try:
        ready = re.search(r"the (\d+) largest buckets are compiled; (\d+) more compile in the background",
                          process.stderr())
        assert ready and int(ready.group(2)) > int(ready.group(1)), process.stderr()
        c = client(process.url)
        greedy = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        with_logprobs = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                             logprobs=2)
        sampled = [c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=3)
                   for _ in range(2)]
        pair: list = [None, None]

        def run(i: int) -> None:
            pair[i] = client(process.url).completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=12,
                                                              temperature=0).choices[0].text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT)
        log = process.stderr()
        still_compiling = log.count("(background)") < int(ready.group(2))
    finally:
        started = time.monotonic()
        status = process.stop(signal.SIGTERM)
        stopped_in = time.monotonic() - started
    log = process.stderr()
    assert status == 0 and "scv-jax serve: stopped" in log and "Traceback" not in log, log
    expected = [tokenizer.decode(offline(tokenizer.encode(p), 12)) for p in PROMPTS]
    assert greedy.choices[0].text == with_logprobs.choices[0].text == pair[0] == expected[0]
    assert pair[1] == expected[1]
    top = with_logprobs.choices[0].logprobs.top_logprobs
    assert len(top) == 12 and all(len(entry) == 2 for entry in top)
    assert sampled[0].choices[0].text == sampled[1].choices[0].text and sampled[0].usage.completion_tokens == 12
    assert "on the calling thread" not in log                  # nothing compiled where the steps run
    assert still_compiling and stopped_in < 60, (still_compiling, stopped_in)
