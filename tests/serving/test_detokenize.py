"""Incremental detokenization and stop strings against whole-text references (hypothesis)."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import example, given, strategies as st

from scv_jax.models import load_tokenizer
from scv_jax.serving.detokenize import IncrementalDetokenizer, TextStream
from scv_jax.demo.hf_export import write_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = st.text(st.sampled_from("ab é€𝄞\n_xyzquickbrownfox"), max_size=40)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bytes")
    write_tokenizer(directory)
    return load_tokenizer(directory)


@pytest.fixture(scope="module", params=["bytes", "llama"])
def any_tokenizer(request, byte_tokenizer):
    """The byte-level tokenizer (multi-byte characters span tokens) and a sentencepiece-like one
    (Metaspace: a text's leading space is dropped by decode)."""
    return byte_tokenizer if request.param == "bytes" else load_tokenizer(ROOT / "tests/models/hf_fixtures/llama")


@given(prompt=TEXT, output=TEXT)
def test_pieces_add_up_to_the_text_after_the_prompt(any_tokenizer, prompt, output):
    tok = any_tokenizer
    context, ids = tok.encode(prompt, add_special_tokens=False), tok.encode(output, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tok.decode, context)
    pieces = [detokenizer.add(t) for t in ids] + [detokenizer.flush()]
    whole = tok.decode(context + ids)
    assert "".join(pieces) == whole[len(tok.decode(context)):]
    assert not any("\ufffd" in p for p in pieces)        # the texts are valid UTF-8: nothing broken emitted


def test_a_character_is_emitted_whole_with_its_last_byte(byte_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_tokenizer.decode)
    assert [detokenizer.add(b) for b in "a𝄞".encode()] == ["a", "", "", "", "𝄞"]
    detokenizer.add(0xE2)                                  # an output cut mid-character ends in U+FFFD
    assert detokenizer.flush() == "\ufffd"


@given(text=TEXT, stops=st.lists(st.text(st.sampled_from("ab é€𝄞x"), min_size=1, max_size=4), max_size=3),
       chunks=st.lists(st.integers(1, 5), min_size=1, max_size=60))
@example(text=" a ", stops=["a", " a "], chunks=[1])   # "a" completes first, " a " starts earlier
def test_stop_strings_end_the_text_at_the_token_completing_one(byte_tokenizer, text, stops, chunks):
    """Whatever the chunking (accepted runs), the tokens used end with the first one whose text completes
    a stop string, and the text ends before the earliest stop string in the text up to that token (one
    that a later token would complete, starting earlier, does not count: it was not there yet)."""
    ids = byte_tokenizer.encode(text)
    stream, emitted, used, position = TextStream(byte_tokenizer.decode, (), stops), "", 0, 0
    for size in chunks * len(ids):
        if position >= len(ids) or stream.stopped:
            break
        update = stream.add(ids[position:position + size])
        emitted, used, position = emitted + update.text, used + update.num_tokens, position + size
    if not stream.stopped:
        emitted += stream.finish()
    completing = next((n for n in range(len(ids) + 1) if any(s in byte_tokenizer.decode(ids[:n]) for s in stops)),
                      None)
    if completing is not None:
        upto = byte_tokenizer.decode(ids[:completing])
        end = min(upto.find(s) for s in stops if s in upto)
        assert emitted == text[:end] and stream.stopped and stream.text == emitted and used == completing
    else:
        assert emitted == text and not stream.stopped and used == len(ids)


def test_text_that_may_begin_a_stop_string_is_held_back(byte_tokenizer):
    stream = TextStream(byte_tokenizer.decode, (), ["STOP"])
    assert stream.add(list(b"abST")).text == "a"       # the last len("STOP") - 1 characters are held
    assert stream.add(list(b"x")).text == "b"
    assert stream.finish() == "STx"                     # the end of the output releases them
