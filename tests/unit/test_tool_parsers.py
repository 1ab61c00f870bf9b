"""Tool-call parsers: each format read whole and streamed in every chunking, with malformed,
truncated and hostile output degrading to content."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tool_call_texts import (
    MISTRAL_ID,
    OPENAI_ID,
    assemble,
    chunked,
    dumps,
    hermes,
    llama3,
    mistral_list,
    mistral_v11,
    pythonic,
    qwen3_xml,
    stream,
)

from frontend.tool_parsers import ToolLimits, get_tool_parser

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WEATHER = {"city": "Paris", "days": 3}
NESTED = {"q": {"a": [1, 2.5, True, None, {"deep": ["x", {"y": 'é"\\\n'}]}], "b": {}}, "e": []}
UNICODE = {"text": "日本語 🙂 naïve", "emoji": "🎉"}


def parser(name: str, **kw):
    return get_tool_parser(name)(**kw)


def check_every_chunking(p, text: str) -> None:
    """Streaming `text` whole, char by char and in a few odd splits reassembles to exactly
    what `extract` returns."""
    want = p.extract(text)
    splits = [[text], list(text), chunked(text, [3, 7, 20, 21]), chunked(text, [1, 2, 50])]
    for chunks in splits:
        got = assemble(stream(p, chunks))
        assert got.content == want.content, chunks
        assert got.named_calls == [(c.name, c.arguments) for c in want.calls], chunks
        ids = [call_id for call_id, _, _ in got.calls]
        assert len(set(ids)) == len(ids)


# --- every format: complete, several calls, content around, unicode, nested arguments -----

CASES = [
    ("hermes", hermes([("get_weather", WEATHER)], before="Let me look.\n"), "Let me look.\n"),
    ("hermes", hermes([("a", NESTED), ("b", UNICODE), ("c", {})], style=2), None),
    (
        "hermes",
        hermes([("a", WEATHER)], before="Sure: ", after="Done, see above."),
        "Sure: \nDone, see above.",
    ),
    ("llama3_json", llama3([("get_weather", WEATHER), ("b", NESTED)]), None),
    ("llama3_json", llama3([("b", UNICODE)], tag=False, style=3), None),
    ("mistral", mistral_list([("a", NESTED), ("b", UNICODE)], before="Calling: "), "Calling: "),
    ("mistral", mistral_v11([("a", WEATHER), ("b", NESTED)], style=1), None),
    ("mistral", mistral_v11([("a", UNICODE)], args_tag=True), None),
    ("pythonic", pythonic([("get_weather", WEATHER), ("b", NESTED), ("c", {})]), None),
]


@pytest.mark.parametrize("name,text,content", CASES)
def test_well_formed_calls_are_extracted_and_stream_to_the_same_result(name, text, content):
    p = parser(name)
    result = p.extract(text)
    assert result.content == content
    assert result.calls, text
    for call in result.calls:
        assert json.loads(call.arguments) is not None
        assert call.arguments == dumps(json.loads(call.arguments))  # the canonical form
        assert (MISTRAL_ID if name == "mistral" else OPENAI_ID).fullmatch(call.id)
    check_every_chunking(p, text)


def test_arguments_are_the_canonical_json_whatever_the_model_spacing():
    text = '<tool_call>{"name":"f","arguments":{"b" :  [1,2],\n "a":"\\u00e9\\/"}}</tool_call>'
    [call] = parser("hermes").extract(text).calls
    assert call.arguments == '{"b": [1, 2], "a": "é/"}'
    check_every_chunking(parser("hermes"), text)


def test_arguments_written_as_a_json_string_are_read_as_the_object_inside():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    [call] = parser("hermes").extract(text).calls
    assert call.arguments == '{"a": 1}'
    check_every_chunking(parser("hermes"), text)


def test_llama3_accepts_parameters_or_arguments_and_text_after_the_calls():
    text = '{"name": "f", "arguments": {"x": 1}}; {"name": "g", "parameters": {}} Anything else?'
    result = parser("llama3_json").extract(text)
    assert [(c.name, c.arguments) for c in result.calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert result.content == " Anything else?"
    check_every_chunking(parser("llama3_json"), text)


def test_mistral_call_id_tag_is_skipped():
    text = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
    [call] = parser("mistral").extract(text).calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert call.id != "a1b2c3d4e" and MISTRAL_ID.fullmatch(call.id)


def test_pythonic_reads_python_literals_as_json():
    text = "[f(a='x', b=-2, c=(1, 2), d={'k': None}, e=True, f=1.5e3, g=null), g()]"
    result = parser("pythonic").extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        (
            "f",
            {"a": "x", "b": -2, "c": [1, 2], "d": {"k": None}, "e": True, "f": 1500.0, "g": None},
        ),
        ("g", {}),
    ]
    check_every_chunking(parser("pythonic"), text)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "temp": {"type": "number"},
                "metric": {"type": "boolean"},
                "opts": {"type": "object"},
                "tags": {"type": ["array", "null"]},
                "note": {"type": "string"},
            },
        },
    },
}


def test_qwen3_xml_types_parameter_values_by_the_tool_schema():
    text = qwen3_xml(
        [
            (
                "get_weather",
                {
                    "city": "San Francisco\nCA",
                    "days": "3",
                    "temp": "21.0",
                    "metric": "True",
                    "opts": '{"a": [1]}',
                    "tags": "['x', 'y']",
                    "note": "null",
                    "extra": "42",
                },
            )
        ],
        before="Checking.\n",
    )
    result = parser("qwen3_xml", tools=[WEATHER_TOOL]).extract(text)
    assert result.content == "Checking.\n"
    [call] = result.calls
    assert json.loads(call.arguments) == {
        "city": "San Francisco\nCA",
        "days": 3,
        "temp": 21,
        "metric": True,
        "opts": {"a": [1]},
        "tags": ["x", "y"],
        "note": None,
        "extra": "42",
    }
    check_every_chunking(parser("qwen3_coder", tools=[WEATHER_TOOL]), text)


def test_qwen3_xml_values_that_do_not_fit_their_type_stay_strings():
    text = qwen3_xml(
        [("get_weather", {"days": "three", "temp": "warm", "metric": "yes", "opts": "{broken"})]
    )
    [call] = parser("qwen3_xml", tools=[WEATHER_TOOL]).extract(text).calls
    assert json.loads(call.arguments) == {
        "days": "three",
        "temp": "warm",
        "metric": "yes",
        "opts": "{broken",
    }


def test_qwen3_xml_tolerates_missing_parameter_end_and_tool_call_tags():
    text = "<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>"
    [call] = parser("qwen3_xml").extract(text).calls
    assert json.loads(call.arguments) == {"a": "1", "b": "x"}
    check_every_chunking(parser("qwen3_xml"), text)


def test_qwen3_xml_streams_string_values_as_they_arrive():
    text = qwen3_xml([("get_weather", {"city": "A long city name"})])
    state = parser("qwen3_xml", tools=[WEATHER_TOOL]).stream()
    seen = []
    for ch in text[: text.index("</parameter>")]:
        seen += state.feed(ch)
    streamed = "".join(d.tool_call.arguments for d in seen if d.tool_call)
    # Rescans of an open call are spaced out, so the last few characters may still wait.
    assert streamed.startswith('{"city": "A long city')
    assert '{"city": "A long city name'.startswith(streamed)


# --- malformed, partial and hostile output degrades to content -----------------------------

MALFORMED = [
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": 1'),  # cut off
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # not an object
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name"'),
    ("llama3_json", '{"name": "Ada", "age": 36}'),  # a JSON answer, not a call
    ("llama3_json", '{"name": "f", "parameters": {"a": }}'),
    ("mistral", "[TOOL_CALLS][{oops}]"),
    ("mistral", "[TOOL_CALLS]bad name{}"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": '),
    ("pythonic", "[f(1, 2)]"),  # positional arguments
    ("pythonic", "[f(a=g())]"),  # not a literal
    ("pythonic", "[__import__('os').system('echo pwned')]"),
    ("pythonic", "[f(a=1, a=2)]"),
    ("pythonic", "[f(a="),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"),  # no </function>
    ("qwen3_xml", "<tool_call>\nplain words\n</tool_call>"),
]


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_output_is_returned_as_content(name, text):
    result = parser(name).extract(text)
    assert result.calls == []
    assert result.content == text
    for chunks in ([text], list(text)):
        got = assemble(stream(parser(name), chunks))  # never raises; what it says is checked
        if not got.calls:
            assert got.content == text


def test_a_cut_off_call_that_was_announced_stops_where_the_text_stopped():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"city": "Par'
    got = assemble(stream(parser("hermes"), list(text)))
    assert got.content == "Hi "
    assert got.named_calls == [("f", '{"city": "Par')]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"])
def test_plain_text_is_content_in_every_format(name):
    text = "The answer is 42 (or [so] {they} say) <b>bold</b>; done."
    assert parser(name).extract(text).content == text
    check_every_chunking(parser(name), text)
    assert parser(name).extract("").content == ""


def test_a_partial_start_tag_is_held_back_until_it_is_known_not_to_be_one():
    state = parser("hermes").stream()
    assert [d.content for d in state.feed("Hello <tool_")] == ["Hello "]
    assert [d.content for d in state.feed("box>")] == ["<tool_box>"]
    state = parser("hermes").stream()
    state.feed("x <tool_")
    assert [d.content for d in state.finish()] == ["<tool_"]


def test_whitespace_between_calls_is_not_content():
    text = '\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n'
    assert parser("hermes").extract(text).content is None
    check_every_chunking(parser("hermes"), text)


def test_too_many_calls_make_the_output_content():
    text = hermes([("f", {})] * 3)
    limited = parser("hermes", limits=ToolLimits(max_calls=2))
    assert limited.extract(text).calls == []
    assert len(assemble(stream(limited, list(text))).calls) == 2


def test_arguments_over_the_size_limit_make_the_output_content():
    text = hermes([("f", {"blob": "x" * 500})])
    limited = parser("hermes", limits=ToolLimits(max_argument_chars=100))
    assert limited.extract(text).calls == []
    [(_, name, args)] = assemble(stream(limited, list(text))).calls
    assert name == "f" and len(args) <= 100


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    text = hermes([("a", {"x": 1}), ("b", {})], before="Two: ")
    p = parser("hermes", parallel_tool_calls=False)
    result = p.extract(text)
    assert [c.name for c in result.calls] == ["a"]
    check_every_chunking(p, text)


def test_deeply_nested_output_fails_cleanly():
    text = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    assert parser("hermes").extract(text).calls == []
    assemble(stream(parser("hermes"), chunked(text, list(range(0, len(text), 97)))))
    deep = "[f(a=" + "[" * 5000 + "]" * 5000 + ")]"
    assert parser("pythonic").extract(deep).calls == []


def test_a_long_argument_streamed_token_by_token_arrives_whole():
    blob = {"code": "print('hello')\n" * 2000, "n": list(range(500))}
    text = hermes([("run", blob)])
    got = assemble(stream(parser("hermes"), chunked(text, list(range(0, len(text), 3)))))
    assert got.named_calls == [("run", dumps(blob))]


# --- property: any layout, any chunking ------------------------------------------------

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
KEYS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)
ARGS = st.dictionaries(KEYS, VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)
CUTS = st.lists(st.integers(0, 10_000), max_size=12)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)


def check_property(name: str, text: str, calls, cuts, content=None) -> None:
    p = parser(name)
    result = p.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        (n, json.loads(dumps(a))) for n, a in calls
    ]
    assert [c.arguments for c in result.calls] == [dumps(a) for n, a in calls]
    assert result.content == content
    got = assemble(stream(p, chunked(text, cuts)))
    assert (got.content, got.named_calls) == (
        result.content,
        [(c.name, c.arguments) for c in result.calls],
    )


@FAST
@given(CALLS, st.integers(0, 3), CUTS, TEXT)
def test_hermes_any_calls_any_chunking(calls, style, cuts, before):
    before = before.replace("<", "(")
    check_property(
        "hermes",
        hermes(calls, before=before, style=style),
        calls,
        cuts,
        before if before.strip() else None,
    )


@FAST
@given(CALLS, st.integers(0, 3), st.booleans(), CUTS)
def test_llama3_any_calls_any_chunking(calls, style, tag, cuts):
    check_property("llama3_json", llama3(calls, tag=tag, style=style), calls, cuts)


@FAST
@given(CALLS, st.integers(0, 3), st.booleans(), st.booleans(), CUTS)
def test_mistral_any_calls_any_chunking(calls, style, list_form, args_tag, cuts):
    text = (
        mistral_list(calls, style=style)
        if list_form
        else mistral_v11(calls, style=style, args_tag=args_tag)
    )
    check_property("mistral", text, calls, cuts)


PY_NAMES = NAMES.filter(lambda s: s not in {"true", "false", "null"})
PY_ARGS = st.dictionaries(PY_NAMES, VALUES, max_size=4)


@FAST
@given(st.lists(st.tuples(PY_NAMES, PY_ARGS), min_size=1, max_size=3), CUTS)
def test_pythonic_any_calls_any_chunking(calls, cuts):
    check_property("pythonic", pythonic(calls), calls, cuts)


PARAM_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="<"), max_size=20
).filter(lambda s: s.lower() != "null")


@FAST
@given(st.dictionaries(PY_NAMES, PARAM_TEXT, min_size=1, max_size=4), CUTS)
def test_qwen3_xml_string_parameters_any_chunking(params, cuts):
    text = qwen3_xml([("f", params)])
    check_property("qwen3_xml", text, [("f", params)], cuts)


FRAGMENTS = st.sampled_from(
    [
        "\\ud83d",  # JSON escapes of a surrogate pair's halves and of é
        "\\ude00",
        "\\u00e9",
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"arguments"',
        '"parameters"',
        ":",
        ",",
        '"f"',
        '"x',
        "1",
        " ",
        "\n",
        "\\",
        '"',
        "[TOOL_CALLS]",
        "[ARGS]",
        "<function=f>",
        "<parameter=a>",
        "</parameter>",
        "</function>",
        "f(",
        ")",
        "a=",
        "'s'",
        "<|python_tag|>",
        ";",
        "null",
        "é",
        "<",
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"]),
    st.lists(FRAGMENTS, max_size=30),
    CUTS,
)
def test_any_output_streams_without_losing_text_and_never_raises(name, parts, cuts):
    """Well-formed output streams to what `extract` says in any chunking; output where no
    call got announced streams back as exactly the text. (A call announced and broken later
    depends on where the chunks fell: it stops where it broke.)"""
    text = "".join(parts)
    p = parser(name)
    result = p.extract(text)
    for chunks in ([text], chunked(text, cuts)):
        got = assemble(stream(p, chunks))
        if result.calls:
            assert (got.content, got.named_calls) == (
                result.content,
                [(c.name, c.arguments) for c in result.calls],
            )
        elif not got.calls:
            assert got.content == (text or None)
