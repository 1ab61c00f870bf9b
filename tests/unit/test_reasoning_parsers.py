"""Reasoning parsers: `<think>` blocks split from the answer, whole and in every chunking,
where the output starts (from the prompt), the token-id boundary for structured outputs, and
reasoning followed by tool calls through the per-choice combiner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_call_texts import chunked, hermes

from frontend.chat_output import ChatOutputParser
from frontend.reasoning import (
    Mode,
    ReasoningBoundary,
    ReasoningParserError,
    get_reasoning_parser,
    is_reasoning_end,
    reasoning_boundary,
    reasoning_end_index,
)
from frontend.tool_parsers import get_tool_parser


def parser(name: str, **kwargs):
    return get_reasoning_parser(name)(kwargs or None)


def streamed(p, mode: Mode, chunks: list[str]) -> tuple[str | None, str | None]:
    state = p.stream(mode)
    pieces = [d for c in chunks for d in state.feed(c)] + state.finish()
    for d in pieces:
        assert (d.reasoning is None) != (d.content is None), "one field per delta"
        assert d.reasoning or d.content, "no empty deltas"
    reasoning = "".join(d.reasoning for d in pieces if d.reasoning is not None)
    content = "".join(d.content for d in pieces if d.content is not None)
    return reasoning or None, content or None


SPLITS = [
    # (parser, mode, output, reasoning, content)
    (
        "deepseek_r1",
        Mode.REASONING,
        "Let me see.\n</think>\n\nIt is 4.",
        "Let me see.\n",
        "\n\nIt is 4.",
    ),
    ("deepseek_r1", Mode.REASONING, "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", Mode.REASONING, "\n<think>\nplan</think>answer", "\nplan", "answer"),
    ("deepseek_r1", Mode.REASONING, "cut off while thinking", "cut off while thinking", None),
    ("deepseek_r1", Mode.REASONING, "done</think>", "done", None),
    ("deepseek_r1", Mode.REASONING, "</think>just the answer", None, "just the answer"),
    ("deepseek_r1", Mode.REASONING, "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", Mode.CONTENT, "no thinking </think> here", None, "no thinking </think> here"),
    ("qwen3", Mode.MAYBE, "<think>\nhmm 日本\n</think>\n\nHi 🙂", "\nhmm 日本\n", "\n\nHi 🙂"),
    ("qwen3", Mode.MAYBE, "Plain answer, no tags.", None, "Plain answer, no tags."),
    ("qwen3", Mode.MAYBE, "  <thinking> is not the tag", None, "  <thinking> is not the tag"),
    ("qwen3", Mode.MAYBE, "<think>truncated", "truncated", None),
    ("qwen3", Mode.REASONING, "thought</think>answer", "thought", "answer"),
    (
        "qwen3",
        Mode.REASONING,
        "I should call it.\n<tool_call>\n{}",
        "I should call it.\n",
        "<tool_call>\n{}",
    ),
    ("qwen3", Mode.CONTENT, "<think>x</think>y", None, "<think>x</think>y"),
    ("deepseek_r1", Mode.REASONING, "", None, None),
]


@pytest.mark.parametrize("name,mode,text,reasoning,content", SPLITS)
def test_split_whole_and_in_every_chunking(name, mode, text, reasoning, content):
    p = parser(name)
    assert p.split(text, mode) == (reasoning, content)
    for chunks in ([text], list(text), chunked(text, [2, 5, 9, 14])):
        assert streamed(p, mode, chunks) == (reasoning, content), chunks


def test_a_tag_split_across_deltas_never_leaks():
    state = parser("deepseek_r1").stream(Mode.REASONING)
    assert [d.reasoning for d in state.feed("abc</th")] == ["abc"]
    assert [d.reasoning for d in state.feed("ought")] == ["</thought"]
    assert [d.content for d in state.feed("</think>ok")] == ["ok"]
    assert state.reasoning_ended
    state = parser("qwen3").stream(Mode.MAYBE)
    assert state.feed("<thi") == [] and state.feed("nk>x") and not state.reasoning_ended


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["deepseek_r1", "qwen3"]),
    st.sampled_from(list(Mode)),
    st.lists(
        st.sampled_from(
            [
                "<think>",
                "</think>",
                "<th",
                "ink>",
                "</",
                "<tool_call>",
                " ",
                "\n",
                "a",
                "é",
                "<",
                ">",
            ]
        ),
        max_size=20,
    ),
    st.lists(st.integers(0, 1000), max_size=8),
)
def test_any_output_splits_the_same_in_any_chunking(name, mode, parts, cuts):
    text = "".join(parts)
    p = parser(name)
    whole = p.split(text, mode)
    # Equal to the whole-text split in any chunking: a tag cut across deltas never leaks.
    assert streamed(p, mode, chunked(text, cuts)) == whole
    reasoning, content = whole
    assert len(reasoning or "") + len(content or "") <= len(text)


def test_where_output_starts_comes_from_the_prompt():
    r1, qwen = parser("deepseek_r1"), parser("qwen3")
    assert r1.mode_after("<｜Assistant｜><think>\n") is Mode.REASONING
    assert r1.mode_after("<｜Assistant｜>") is Mode.REASONING  # R1 always thinks first
    assert r1.mode_after("...<think>\n\n</think>\n\n") is Mode.CONTENT
    assert qwen.mode_after("<|im_start|>assistant\n") is Mode.MAYBE
    assert qwen.mode_after("<|im_start|>assistant\n<think>\n") is Mode.REASONING
    assert qwen.mode_after("<|im_start|>assistant\n<think>\n\n</think>\n\n") is Mode.CONTENT
    off = parser("qwen3", enable_thinking=False)
    assert off.mode_after("<|im_start|>assistant\n") is Mode.CONTENT
    assert off.split("<think>x</think>y", off.mode_after("")) == (None, "<think>x</think>y")


def test_unknown_reasoning_parser_lists_the_known_ones():
    with pytest.raises(ReasoningParserError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("r2")


# --- the token-id boundary for structured outputs --------------------------------------------

SPECIAL = {"<think>": [900], "</think>": [901]}


def by_id(text: str) -> list[int]:
    return SPECIAL[text]


def by_byte(text: str) -> list[int]:
    return list(text.encode())


def test_reasoning_end_in_token_ids_with_one_id_tags():
    start, end = [900], [901]
    assert is_reasoning_end([1, 900, 5, 901, 7], start, end)
    assert not is_reasoning_end([1, 900, 5], start, end)
    assert not is_reasoning_end([901, 1, 900, 2], start, end)  # reopened after an old end
    assert not is_reasoning_end([], start, end)


def test_reasoning_end_in_token_ids_with_multi_token_tags():
    start, end = by_byte("<think>"), by_byte("</think>")
    ids = by_byte("x<think>plan</think>answer")
    assert is_reasoning_end(ids, start, end)
    assert not is_reasoning_end(by_byte("<think>plan</thin"), start, end)


def test_constrained_decoding_starts_after_the_end_tag():
    p = parser("qwen3")
    boundary = reasoning_boundary(p, Mode.REASONING, by_id)
    assert boundary == ReasoningBoundary(True, (900,), (901,))
    assert reasoning_end_index([5, 6], boundary) is None
    assert reasoning_end_index([5, 6, 901, 7], boundary) == 3
    assert reasoning_end_index([5, 6, 901, 7], boundary, start=2) == 3
    assert reasoning_end_index([5], reasoning_boundary(p, Mode.CONTENT, by_id)) == 0
    assert reasoning_boundary(p, Mode.MAYBE, by_id).in_reasoning
    multi = reasoning_boundary(p, Mode.REASONING, by_byte)
    ids = by_byte("plan</think>{")
    assert reasoning_end_index(ids, multi) == len(by_byte("plan</think>"))


# --- reasoning, then tool calls: the per-choice combiner ------------------------------------


def combined(text: str, mode: Mode, chunks: list[str], **kw):
    out = ChatOutputParser(parser("qwen3"), mode, get_tool_parser("hermes")(), **kw)
    whole = out.parse(text)
    state = out.stream()
    pieces = [d for c in chunks for d in state.feed(c)] + state.finish()
    return whole, pieces, state


def test_reasoning_then_tool_calls_whole_and_streamed():
    text = "<think>The user wants weather.</think>\n\n" + hermes(
        [("get_weather", {"city": "Oslo"})]
    )
    for chunks in ([text], list(text)):
        whole, pieces, state = combined(text, Mode.MAYBE, chunks)
        assert whole.reasoning == "The user wants weather."
        assert whole.content is None
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [
            ("get_weather", '{"city": "Oslo"}')
        ]
        assert "".join(d.reasoning for d in pieces if d.reasoning) == whole.reasoning
        assert not [d for d in pieces if d.content]
        args = "".join(d.tool_call.arguments for d in pieces if d.tool_call)
        assert args == '{"city": "Oslo"}' and state.tool_calls_sent == 1
        assert state.reasoning_ended


def test_a_tool_call_inside_unclosed_reasoning_ends_it():
    text = "I need the tool.\n" + hermes([("f", {})])
    whole, pieces, state = combined(text, Mode.REASONING, list(text))
    assert whole.reasoning == "I need the tool.\n"
    assert [c.name for c in whole.tool_calls] == ["f"] and state.tool_calls_sent == 1


def test_include_reasoning_false_drops_it_but_keeps_the_answer():
    text = "<think>secret</think>Answer."
    whole, pieces, _ = combined(text, Mode.MAYBE, list(text), include_reasoning=False)
    assert (whole.reasoning, whole.content) == (None, "Answer.")
    assert [d.content for d in pieces] and not [d for d in pieces if d.reasoning]


def test_no_parsers_pass_text_through():
    out = ChatOutputParser()
    assert out.parse("<think>x</think>").content == "<think>x</think>"
    state = out.stream()
    assert [d.content for d in state.feed("ab") + state.finish()] == ["ab"]
