"""``scv-jax serve`` on the real ``Engine`` with the tiny byte-level checkpoint (the demo draft exported):
greedy completions and chats, streamed and not, equal to offline ``Engine`` greedy decoding of the
same prompt, with a draft model + adaptive k, with n-gram drafting and with an EAGLE-3 head; 64
concurrent streams; the KV pool full again afterwards; a fault inside a real step."""

from __future__ import annotations

import signal
import string
import threading
import time

import openai
import pytest

from tests.models.eagle3_fixtures.heads import head_config, head_tensors
from tests.models.test_eagle3 import write_head
from tests.serving.conftest import REQUEST_TIMEOUT, client, metrics, spec_metrics, wait_for
from tests.serving.harness import ServerProcess

NAME = "tiny"
MAX_LEN = 192
# --no-warmup: only the shapes the tests use compile (a full warm-up of greedy and sampled steps for every
# k and batch bucket takes minutes on 2 CPU cores)
COMMON = ["--served-model-name", NAME, "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--max-num-seqs", "4",
          "--no-warmup"]
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def __init__(self", "for i in range(10):"]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """A draft model (the checkpoint itself: every draft is accepted unless sampling rejects it)."""
    process = ServerProcess(["--model", str(checkpoint), *COMMON, "--draft", str(checkpoint), "--k", "2"],
                            tmp_path_factory.mktemp("logs") / "draft.log", fault_on="FAULT")
    yield process
    assert process.stop(signal.SIGTERM) == 0, process.stderr()


@pytest.fixture(scope="module")
def offline(checkpoint):
    """prompt ids, max_tokens -> the offline Engine's greedy tokens (target only)."""
    import scv_jax
    from scv_jax.models import load_hf

    engine = scv_jax.Engine(load_hf(checkpoint, dtype="float32"), None,
                            config=scv_jax.DecoderConfig(k=0, max_seq_len=MAX_LEN, num_blocks=64,
                                                         batch_buckets=(1,)))
    cache = {}

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            rid = engine.add_request(prompt, scv_jax.SamplingParams(max_tokens=max_tokens))
            tokens = []
            for _ in range(max_tokens + 2):
                for out in engine.step():
                    assert out.request_id == rid
                    tokens = list(out.token_ids)
                if not engine.has_unfinished():
                    break
            cache[key] = tokens
        return cache[key]
    return greedy


@pytest.mark.slow
def test_greedy_completions_equal_offline_decoding(server, offline, tokenizer):
    c = client(server.url)
    for prompt in PROMPTS:
        out = c.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
        expected = offline(tokenizer.encode(prompt), 40)
        assert out.usage.completion_tokens == len(expected) == 40
        assert out.choices[0].text == tokenizer.decode(expected), prompt
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True))
        assert streamed == out.choices[0].text
    spec = out.model_extra["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0    # it did speculate


def test_num_speculative_tokens_caps_a_requests_drafts(server, offline, tokenizer):
    """``extra_body={"num_speculative_tokens": n}``: at 0 the request drafts nothing (vLLM's
    ``metrics.speculative_decoding`` says so) while its default twin drafts; at 1 a chat stream's last
    chunk says one draft a step; the greedy text is the target's either way."""
    c = client(server.url)
    prompt, expected = "def main(", tokenizer.decode(offline(tokenizer.encode("def main("), 24))
    outs = {cap: c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={} if cap is None else {"num_speculative_tokens": cap})
            for cap in (None, 0)}
    assert [out.choices[0].text for out in outs.values()] == [expected] * 2
    free, off = (spec_metrics(outs[cap].model_dump()) for cap in (None, 0))
    assert free["num_spec_tokens"] == 2 and free["num_draft_tokens"] > 0 and free["num_accepted_draft_tokens"] > 0
    assert off["num_spec_tokens"] == off["num_draft_tokens"] == off["num_spec_steps"] == 0
    messages = [{"role": "user", "content": "write a function"}]
    *_, last = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"num_speculative_tokens": 1})
    one = spec_metrics(last.model_dump())
    assert one["num_spec_tokens"] == 1 and one["num_draft_tokens"] == one["num_spec_steps"] > 0


def test_greedy_chat_equals_offline_decoding_of_the_rendered_prompt(server, offline, tokenizer):
    messages = [{"role": "user", "content": "write a function"}]
    rendered = "### user\nwrite a function\n### assistant\n"
    out = client(server.url).chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    assert out.usage.prompt_tokens == len(rendered.encode())
    assert out.choices[0].message.content == tokenizer.decode(offline(list(rendered.encode()), 24))


@pytest.mark.slow
def test_64_concurrent_streams_then_the_pool_is_full_again(server, offline, tokenizer):
    prompts = [f"def f{i}(x):\n    return x" for i in range(64)]
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        chunks = client(server.url).completions.create(model=NAME, prompt=prompts[i], max_tokens=16,
                                                       temperature=0, stream=True)
        results[i] = "".join(ch.choices[0].text for ch in chunks)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * REQUEST_TIMEOUT)
    assert results == [tokenizer.decode(offline(tokenizer.encode(p), 16)) for p in prompts]
    deadline = time.monotonic() + 30
    while metrics(server.url)[("vllm:kv_cache_usage_perc", ())] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = metrics(server.url)
    assert m[("vllm:kv_cache_usage_perc", ())] == 0 and m[("vllm:num_requests_running", ())] == 0


def test_sampled_requests_with_a_seed_repeat(server):
    c = client(server.url)
    texts = [c.completions.create(model=NAME, prompt="def main(", max_tokens=20, temperature=1.0, top_p=0.9,
                                  seed=7, extra_body={"top_k": 20}).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


def test_a_fault_in_a_real_step_fails_its_request_and_the_server_goes_on(server, offline, tokenizer):
    c = client(server.url)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        c.completions.create(model=NAME, prompt="FAULT", max_tokens=8, temperature=0)
    out = c.completions.create(model=NAME, prompt="def main(", max_tokens=12, temperature=0)
    assert out.choices[0].text == tokenizer.decode(offline(tokenizer.encode("def main("), 12))


@pytest.mark.parametrize("flags", [["--ngram", "--adaptive"], ["--suffix"]], ids=["ngram-adaptive", "suffix"])
@pytest.mark.slow
def test_host_drafters_greedy_outputs_equal_offline_decoding(checkpoint, tmp_path, offline, tokenizer, flags):
    process = ServerProcess(["--model", str(checkpoint), *COMMON, *flags], tmp_path / "ngram.log")
    try:
        c = client(process.url)
        prompt = "x = 1\nx = 1\nx = 1\n"          # repetitive: matches to draft from (and, the second
        for stream in (False, True):                # time, the first answer for suffix decoding)
            kwargs = dict(model=NAME, prompt=prompt, max_tokens=32, temperature=0)
            text = "".join(ch.choices[0].text for ch in c.completions.create(**kwargs, stream=True)) if stream \
                else c.completions.create(**kwargs).choices[0].text
            assert text == tokenizer.decode(offline(tokenizer.encode(prompt), 32))
    finally:
        assert process.stop(signal.SIGINT) == 0, process.stderr()


@pytest.mark.slow
def test_an_eagle3_head_serves_the_targets_greedy_text(checkpoint, tmp_path, offline, tokenizer):
    """``serve --eagle3``: a random head for the checkpoint (hidden size 128, 256 ids, 1 layer: aux layer
    ids 0) drafts, and the completion is the target's greedy text."""
    spec = dict(hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=128, target_vocab=256, draft_vocab=64)
    head = write_head(tmp_path / "head", head_tensors(**spec, seed=2), head_config(**spec, aux_layers=(0, 0, 0)))
    process = ServerProcess(["--model", str(checkpoint), *COMMON, "--eagle3", str(head), "--k", "2"],
                            tmp_path / "eagle3.log")
    try:
        out = client(process.url).completions.create(model=NAME, prompt="def main(", max_tokens=12, temperature=0)
        assert out.choices[0].text == tokenizer.decode(offline(tokenizer.encode("def main("), 12))
        assert out.model_extra["spec_decode"]["num_draft_tokens"] > 0
    finally:
        assert process.stop(signal.SIGINT) == 0, process.stderr()


def test_stop_strings_cut_the_greedy_text(server, offline, tokenizer):
    prompt = "import os\nimport sys\n"
    full = tokenizer.decode(offline(tokenizer.encode(prompt), 40))
    stop = full[12:15]                              # three bytes: three tokens, within or across accepted runs
    out = client(server.url).completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=stop)
    assert out.choices[0].text == full[:full.find(stop)] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(full[:full.find(stop) + 3].encode())


def test_greedy_logprobs_rank_the_emitted_token_first(server):
    out = client(server.url).completions.create(model=NAME, prompt="def main(", max_tokens=6, temperature=0,
                                                logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        best = max(top, key=top.get)
        assert best == token and abs(top[best] - value) < 1e-5


def test_logit_controls_are_honoured(server, offline, tokenizer):
    """A huge logit_bias makes greedy output its token; a bad word (of one token, of two) never appears;
    penalties change the greedy text (vLLM's meanings, through the openai client)."""
    c = client(server.url)
    # a greedy output with a character that is not a space (vLLM strips a bad word's leading spaces)
    prompt, full = next((p, text) for p in PROMPTS for text in [tokenizer.decode(offline(tokenizer.encode(p), 24))]
                        if text.strip())
    [z] = tokenizer.encode("Z", add_special_tokens=False)
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(z): 100})
    assert out.choices[0].text == "Z" * 8
    common = max(set(full) - set(string.whitespace), key=full.count)
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"bad_words": [common]})
    assert common in full and common not in out.choices[0].text and out.choices[0].text
    pair = next(full[i:i + 2] for i in range(len(full) - 1) if not full[i].isspace())
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"bad_words": [pair]})           # two tokens: the second after the first
    assert pair in full and pair not in out.choices[0].text and out.choices[0].text != full
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, presence_penalty=2,
                               frequency_penalty=2, extra_body={"repetition_penalty": 1.5})
    assert out.choices[0].text != full
    sampled = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                        temperature=0.8, seed=3, logit_bias={str(z): 100})
    assert sampled.choices[0].message.content == "Z" * 6


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, offline, tokenizer):
    """The second request of a prompt reports its cached prompt tokens in ``usage`` (OpenAI's
    ``prompt_tokens_details.cached_tokens``) and the hit counters count them; the text is the same."""
    c, prompt = client(server.url), "# a prompt long enough for a few blocks of 16 tokens: " + string.ascii_letters
    before = metrics(server.url)
    first = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    second = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    cached = (len(prompt.encode()) - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text == tokenizer.decode(offline(tokenizer.encode(prompt), 8))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == cached > 0
    hits, queries = ("vllm:prefix_cache_hits_total", ()), ("vllm:prefix_cache_queries_total", ())
    counted = lambda: (metrics(server.url)[hits] - before[hits],  # noqa: E731 (the engine thread counts after a step)
                       metrics(server.url)[queries] - before[queries])
    assert wait_for(lambda: counted() == (cached, 2 * len(prompt.encode()))), counted()
