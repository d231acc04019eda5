"""Every request field is honoured or refused, never ignored: on the fake engine, with the ``openai``
client, the fields this server does not implement are a 400 naming them unless they ask for nothing,
an unknown field is a 400 naming it (``--allow-unknown-fields``: ignored, and said so), the fields it
implements (``include_stop_str_in_output``, ``stream_options``) do what vLLM / OpenAI do, and errors
name the field the client sent."""

from __future__ import annotations

import signal

import openai
import pytest

from scv_jax.sampling_params import MAX_BAD_WORD_LEN, MAX_BAD_WORDS
from scv_jax.serving.protocol import ApiError, ChatRequest, CompletionRequest, bad_words_token_ids
from tests.serving.conftest import client, post_error
from tests.serving.fake_engine import expected_tokens
from tests.serving.harness import ServerProcess

NAME = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    process = ServerProcess(["--model", str(checkpoint), "--served-model-name", NAME], tmp_path_factory.mktemp("logs")
                            / "fields.log", fake=True)
    yield process
    assert process.stop(signal.SIGINT) == 0, process.stderr()


def _body(path: str, **fields) -> dict:
    first = {"messages": MESSAGES} if path == CHAT else {"prompt": "hello"}
    return {"model": NAME, **first, "max_tokens": 8, **fields}


@pytest.mark.parametrize("params,model", [
    ("openai.types.completion_create_params.CompletionCreateParamsBase", CompletionRequest),
    ("openai.types.chat.completion_create_params.CompletionCreateParamsBase", ChatRequest),
])
def test_every_field_of_the_openai_client_is_declared(params, model):
    """The installed ``openai`` package's request fields (a newer one may add some): none is unknown."""
    module, name = params.rsplit(".", 1)
    fields = getattr(__import__(module, fromlist=[name]), name).__annotations__
    assert set(fields) - set(model.model_fields) == set()


REFUSED = [
    (path, field, value) for path in (COMPLETIONS, CHAT) for field, value in [
        ("best_of", 3), ("echo", True),
        ("length_penalty", 0.5), ("use_beam_search", True), ("skip_special_tokens", False),
        ("spaces_between_special_tokens", False), ("truncate_prompt_tokens", 4), ("prompt_logprobs", 1),
        ("guided_decoding_backend", "xgrammar"), ("guided_whitespace_pattern", " *"),
        ("priority", 1), ("request_id", "mine"), ("logits_processors", ["m.P"]), ("return_token_ids", True),
        ("return_tokens_as_token_ids", True), ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}),
        ("no_stop_trim", True), ("return_hidden_states", True),          # SGLang's, that the routers send
    ]
] + [(COMPLETIONS, "suffix", "end"), (COMPLETIONS, "add_special_tokens", False),
     (COMPLETIONS, "prompt_embeds", "AAAA")] + [(CHAT, field, value) for field, value in [
         ("reasoning_effort", "low"),
         ("reasoning_effort", "none"),
         ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
         ("web_search_options", {}), ("verbosity", "low"), ("moderation", {"model": "m"}), ("metadata", {"a": "b"}),
         ("store", True), ("service_tier", "flex"), ("prompt_cache_retention", "24h"),
         ("prompt_cache_options", {"mode": "explicit"}), ("continue_final_message", True),
         ("add_special_tokens", True), ("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"a": 1}),
         ("documents", [{"text": "x"}]), ("mm_processor_kwargs", {"a": 1}), ("structural_tag", "{}")]]


@pytest.mark.parametrize("path,field,value", REFUSED)
def test_fields_not_implemented_are_400s_naming_them(server, path, field, value):
    error = post_error(server.url, path, _body(path, **{field: value}), 400)
    assert (error["param"], error["code"]) == (field, "unsupported_parameter"), error
    assert field in error["message"]


DEFAULTS = dict(n=1, best_of=1, echo=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                response_format={"type": "text"}, repetition_penalty=1, length_penalty=1.0, use_beam_search=False,
                min_tokens=0, skip_special_tokens=True, spaces_between_special_tokens=True, bad_words=[],
                truncate_prompt_tokens=None, priority=0, logits_processors=[], vllm_xargs={}, user="u",
                cache_salt="s", stream_options=None, include_stop_str_in_output=False, no_stop_trim=False,
                return_hidden_states=False)
CHAT_DEFAULTS = dict(tools=[], tool_choice="none", functions=[], function_call="auto", parallel_tool_calls=True,
                     reasoning_effort=None, modalities=["text"], metadata={}, store=False, service_tier="auto",
                     continue_final_message=False, add_special_tokens=False, chat_template_kwargs={},
                     include_reasoning=True, safety_identifier="s", prompt_cache_key="k", separate_reasoning=True,
                     stream_reasoning=True)


def test_fields_at_their_defaults_are_accepted(server):
    c = client(server.url)
    plain = c.completions.create(model=NAME, prompt="hello", max_tokens=8, temperature=0)
    out = c.completions.create(model=NAME, prompt="hello", max_tokens=8, temperature=0,
                               extra_body={**DEFAULTS, "suffix": "", "add_special_tokens": True})
    assert out.choices[0].text == plain.choices[0].text
    plain = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    out = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                    extra_body={**DEFAULTS, **CHAT_DEFAULTS})
    assert out.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_an_unknown_field_is_a_400_naming_it(server, path):
    error = post_error(server.url, path, _body(path, max_token=3), 400)
    assert (error["param"], error["code"]) == ("max_token", "unknown_parameter") and "max_token" in error["message"]
    with pytest.raises(openai.BadRequestError, match="max_token"):
        client(server.url).completions.create(model=NAME, prompt="x", extra_body={"max_token": 3})
    error = post_error(server.url, path, _body(path, stream=True, stream_options={"include_usgae": True}), 400)
    assert error["param"] == "stream_options" and "include_usgae" in error["message"]


def test_allow_unknown_fields_ignores_them_and_says_so(checkpoint, tmp_path):
    process = ServerProcess(["--model", str(checkpoint), "--allow-unknown-fields"], tmp_path / "unknown.log", fake=True)
    try:
        c = client(process.url)
        response = c.completions.with_raw_response.create(model=None, prompt="x", max_tokens=3,
                                                          extra_body={"max_token": 9, "colour": "red"})
        assert response.headers["x-ignored-fields"] == "colour,max_token"
        assert response.parse().usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):     # known fields are still checked
            c.completions.create(model=None, prompt="x", presence_penalty=3)
    finally:
        assert process.stop(signal.SIGTERM) == 0, process.stderr()
    assert "ignored unknown request fields colour, max_token" in process.stderr()


@pytest.mark.parametrize("fields,param", [
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 8, "max_tokens": 9}, "max_tokens"),     # not one silently ignored for the other
    ({"max_tokens": 10_000}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop_token_ids": list(range(17))}, "stop_token_ids"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_errors_name_the_field_the_client_sent(server, fields, param):
    body = {"model": NAME, "messages": MESSAGES, **fields}
    assert post_error(server.url, CHAT, body, 400)["param"] == param


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),      # "auto" by default
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "function_call"),
    ({"tool_choice": "required"}, "tool_choice"), ({"function_call": {"name": "f"}}, "function_call"),
])
def test_auto_tool_calls_need_a_known_format(server, fields, param):
    """The tiny checkpoint's template has no tool-call format: "auto" (the default with tools) is a 400
    naming the choice's field (the server was given no --tool-call-parser), as is a forced call
    without tools."""
    error = post_error(server.url, CHAT, _body(CHAT, **fields), 400)
    assert error["param"] == param and param in error["message"], error


def test_too_many_stop_token_ids_name_them_in_completions(server):
    body = _body(COMPLETIONS, stop_token_ids=list(range(17)))
    assert post_error(server.url, COMPLETIONS, body, 400)["param"] == "stop_token_ids"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(server, tokenizer, stream):
    full = tokenizer.decode(expected_tokens(list(b"hello"), 60))
    c = client(server.url)

    def text(**fields) -> tuple[str, str]:
        kwargs = dict(model=NAME, prompt="hello", max_tokens=60, temperature=0, extra_body=fields)
        if not stream:
            choice = c.completions.create(**kwargs).choices[0]
            return choice.text, choice.finish_reason
        chunks = list(c.completions.create(**kwargs, stream=True))
        return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason

    cut = full.find("wörld")
    assert text(stop=["zzz", "wörld"], include_stop_str_in_output=True) == (full[:cut + 5], "stop")
    assert text(stop=["zzz", "wörld"]) == (full[:cut], "stop")
    stop = next(t for t in expected_tokens(list(b"hello"), 60)[3:] if t < 128)     # an ASCII character's token
    first = full.index(chr(stop))
    assert text(stop_token_ids=[stop], include_stop_str_in_output=True) == (full[:first + 1], "stop")
    assert text(stop_token_ids=[stop]) == (full[:first], "stop")


def test_bad_words_take_vllms_variants():
    """vLLM's variants of a bad word: without leading spaces, and with one where that is another first
    token and as many tokens; a word of no token or too many, or too many words of several tokens, is a
    400 naming bad_words."""
    vocab = {"cat": [1], " cat": [2], "dog": [3], " dog": [9, 3], "hi": [4], " hi": [4], "a b": [5, 6], " a b": [7, 6],
             "": [], " ": [8], "long": list(range(MAX_BAD_WORD_LEN + 1)), " long": [1]}

    def encode(text: str) -> list[int]:           # "w<i>" and " w<i>": 2 tokens, the same first
        return vocab[text] if text in vocab else [100 + int(text.strip()[1:]), 99]

    assert bad_words_token_ids(["cat", "  dog", " hi", "cat", "a b"], encode) == (
        (1,), (2,), (3,), (4,), (5, 6), (7, 6))
    assert len(bad_words_token_ids([f"w{i}" for i in range(MAX_BAD_WORDS)], encode)) == MAX_BAD_WORDS
    for words, match in ([[""], '"" is 0'], [["long"], f'"long" is {MAX_BAD_WORD_LEN + 1}'],
                         [[f"w{i}" for i in range(MAX_BAD_WORDS + 1)], f"got {MAX_BAD_WORDS + 1}"]):
        with pytest.raises(ApiError, match=rf"^bad_words: .*{match}$") as e:
            bad_words_token_ids(words, encode)
        assert e.value.param == "bad_words"
