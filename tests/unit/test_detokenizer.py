"""Incremental detokenization and stop strings (frontend/detokenizer.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))


def stream_all(detok: IncrementalDetokenizer, ids: list[int], final_at_end=True) -> list[str]:
    pieces = []
    for i in ids:
        stop = detok.add([i])
        pieces.append(detok.take(final=stop is not None))
        if stop is not None:
            return pieces
    pieces.append(detok.take(final=final_at_end))
    return pieces


def test_multibyte_characters_split_across_tokens_come_out_whole(tok):
    text = "héllo wörld ✓ 你好 🎉"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text)  # byte-level: some characters span several tokens
    detok = IncrementalDetokenizer(tok, [104, 105])
    pieces = stream_all(detok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tok):
    prompt = tok.encode("ab✓", add_special_tokens=False).ids[:-1]  # cut inside ✓
    detok = IncrementalDetokenizer(tok, prompt)
    out = tok.encode("xyz", add_special_tokens=False).ids
    assert "".join(stream_all(detok, out)) == "xyz"


def test_stop_string_truncates_and_is_excluded_by_default(tok):
    ids = tok.encode("hello STOP world", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    pieces = stream_all(detok, ids)
    assert "".join(pieces) == "hello "
    assert detok.text == "hello "


def test_stop_string_included_on_request(tok):
    ids = tok.encode("hello STOP world", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop=True)
    assert "".join(stream_all(detok, ids)) == "hello STOP"


def test_streaming_holds_back_what_could_begin_a_stop_string(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["XYZ"])
    ids = tok.encode("abXY", add_special_tokens=False).ids
    emitted = "".join(detok.take(final=False) for _ in [detok.add(ids)])
    assert "XY" not in emitted  # might still become XYZ
    detok.add(tok.encode("Q", add_special_tokens=False).ids)
    assert emitted + detok.take(final=False) + detok.take(final=True) == "abXYQ"


def test_the_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("one two three", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [], stop=["three", "two"])
    stop = None
    for i in ids:
        stop = detok.add([i]) or stop
        if stop:
            break
    assert stop == "two" and detok.text == "one "
