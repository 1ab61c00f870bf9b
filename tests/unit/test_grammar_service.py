"""Structured outputs' pieces: the wire struct, the compiler's checks and messages, the
service's cache and tickets, the matcher, and the step bitmask (engine_core/)."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest
import torch
import xgrammar as xgr

from engine_core.grammar_compiler import (
    MAX_JSON_DEPTH,
    GrammarError,
    choice_grammar,
    is_lark,
    short_reason,
)
from engine_core.grammar_matcher import RequestGrammar, StepBitmask
from engine_core.structured_output import GrammarService
from protocol.messages import SamplingParams, StructuredOutputs

pytestmark = pytest.mark.timeout(60)

VOCAB = 320  # the tiny model's lm_head rows; its tokenizer has 259 tokens
EOS = 258


@pytest.fixture(scope="module")
def service(tiny_model):
    svc = GrammarService(tiny_model("llama"), VOCAB, eos_token_ids=[EOS], cache_size=4)
    yield svc
    svc.close()


def grammar_of(service: GrammarService, spec: StructuredOutputs) -> RequestGrammar:
    ticket = service.submit(spec, "r")
    assert ticket.wait(30)
    return ticket.grammar()


def error_of(service: GrammarService, spec: StructuredOutputs) -> str:
    ticket = service.submit(spec, "r")
    assert ticket.wait(30)
    with pytest.raises(GrammarError) as info:
        ticket.grammar()
    return str(info.value)


def accepts(grammar: RequestGrammar, text: str) -> bool:
    """Whether the grammar takes `text` (byte tokens) and then ends on EOS."""
    return all(grammar.accept(b) for b in text.encode()) and grammar.accept(EOS)


def allowed(grammar: RequestGrammar) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    return {t for t in range(VOCAB) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


# --- the wire struct ---


def test_sampling_params_carry_a_constraint_and_older_messages_still_decode():
    spec = StructuredOutputs(choice=["a", "b"], disable_any_whitespace=True, param="guided_choice")
    params = SamplingParams(max_tokens=3, structured_outputs=spec)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back == params
    # A reader that predates the field (its last field is allowed_token_ids) decodes it too.
    old = msgspec.msgpack.encode(SamplingParams(max_tokens=3))
    assert msgspec.msgpack.decode(old, type=SamplingParams).structured_outputs is None


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(), "got none"),
        (StructuredOutputs(json="{}", regex="a"), "got json, regex"),
        (StructuredOutputs(json_object=True, choice=["x"]), "got choice, json_object"),
    ],
)
def test_exactly_one_constraint_kind_is_required(spec, message):
    with pytest.raises(ValueError, match=message):
        _ = spec.kind


def test_the_key_is_stable_and_covers_the_constraint_but_not_the_field_name():
    a = StructuredOutputs(regex="[a-z]+")
    assert a.key() == StructuredOutputs(regex="[a-z]+", param="guided_regex").key()
    assert (
        a.key() == msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=StructuredOutputs).key()
    )
    assert a.key() != StructuredOutputs(grammar="[a-z]+").key()
    j = StructuredOutputs(json='{"type":"object"}')
    assert j.key() != StructuredOutputs(json='{"type":"object"}', disable_any_whitespace=True).key()
    assert len(a.key()) == 16


# --- compiler helpers ---


def test_choices_with_quotes_backslashes_and_control_characters_are_matched_exactly(service):
    choices = ['say "hi"', "back\\slash", "line\nbreak", "tab\there", "\x01F\x7f", "éa", "é✓🎉", ""]
    spec = StructuredOutputs(choice=choices)
    for choice in choices:
        assert accepts(grammar_of(service, spec), choice), choice
    assert not accepts(grammar_of(service, spec), "say hi")


def test_choice_grammar_is_gbnf_with_one_literal_per_choice():
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'


def test_a_grammar_without_a_gbnf_rule_is_read_as_lark():
    assert not is_lark('root ::= "a"\n')
    assert not is_lark('# a comment\nroot ::= x\nx ::= "a"')
    assert is_lark('start: "a" | "b"')
    assert is_lark('// root ::= "a" in a comment only\nstart: "a"')


def test_compiler_reasons_lose_their_log_prefix_source_path_and_echo():
    raw = RuntimeError(
        "[22:17:22] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) "
        "is false: Failed to parse JSON: [22:17:22] /project/cpp/support/recursion_guard.h:36: "
        "too deep\n"
    )
    assert short_reason(raw) == "Failed to parse JSON: too deep"
    lark = RuntimeError("Lark error at line 1, column 8: unknown name 'foo'\nstart: foo\n   ^")
    assert short_reason(lark) == "Lark error at line 1, column 8: unknown name 'foo'"
    assert len(short_reason(RuntimeError("x" * 5000))) == 300


# --- the service: errors name the field, never hang ---


@pytest.mark.parametrize(
    "spec, expected",
    [
        (StructuredOutputs(regex="[.*"), "structured_outputs.regex: Regex parsing error"),
        (StructuredOutputs(regex="a\x00"), "structured_outputs.regex: The regex must not contain"),
        (StructuredOutputs(regex=r"(a)\1"), "Backreference is not supported"),
        (StructuredOutputs(json="{nope"), "structured_outputs.json: the JSON schema is not valid"),
        (
            StructuredOutputs(json='{"type": "foo"}'),
            'structured_outputs.json: Unsupported type "foo"',
        ),
        (
            StructuredOutputs(json='{"$ref": "#/$defs/gone"}', param="response_format.json_schema"),
            "response_format.json_schema: ",
        ),
        (StructuredOutputs(grammar='root ::= "a" |'), "structured_outputs.grammar: EBNF parser"),
        (StructuredOutputs(grammar="start: missing"), "unknown name 'missing'"),
        (StructuredOutputs(choice=[]), "structured_outputs.choice: give at least one choice"),
        (StructuredOutputs(structural_tag="{}"), "structured_outputs.structural_tag: "),
        (StructuredOutputs(structural_tag='{"structures": [{}], "triggers": []}'), "missing field"),
        (StructuredOutputs(regex="a", choice=["a"]), "set exactly one of"),
    ],
)
def test_an_invalid_constraint_fails_its_ticket_with_a_short_message(service, spec, expected):
    message = error_of(service, spec)
    assert expected in message
    assert "\n" not in message and ".cc:" not in message and "Traceback" not in message


def test_a_constraint_over_the_byte_limit_is_refused_before_compiling(tiny_model):
    svc = GrammarService(tiny_model("llama"), VOCAB, eos_token_ids=[EOS], max_spec_bytes=100)
    ticket = svc.submit(StructuredOutputs(choice=["x" * 60, "y" * 60], param="guided_choice"))
    assert ticket.ready()  # answered at once
    with pytest.raises(
        GrammarError, match=r"^guided_choice: the constraint is 120 bytes; the limit is 100$"
    ):
        ticket.grammar()
    assert svc.num_compiled == 0
    svc.close()


def test_json_schemas_nested_too_deeply_are_refused(service):
    deep = '{"type":"array","items":' * MAX_JSON_DEPTH + "{}" + "}" * MAX_JSON_DEPTH
    assert f"nests deeper than {MAX_JSON_DEPTH} levels" in error_of(
        service, StructuredOutputs(json=deep)
    )
    very_deep = "[" * 5000 + "]" * 5000  # deeper than Python's own parser goes
    assert "the JSON schema nests too deeply" in error_of(
        service, StructuredOutputs(json=very_deep)
    )


@pytest.mark.parametrize(
    "schema, keyword, path",
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems", "/"),
        (
            {"type": "object", "properties": {"a": {"not": {"type": "null"}}}},
            "not",
            "/properties/a",
        ),
        ({"anyOf": [{"type": "integer"}, {"if": {}, "then": {}}]}, "if", "/anyOf/1"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "/"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength", "/"),
    ],
)
def test_schema_keywords_xgrammar_would_ignore_are_refused_with_their_place(
    service, schema, keyword, path
):
    message = error_of(service, StructuredOutputs(json=json.dumps(schema)))
    assert keyword in message and f"(at {path})" in message


def test_a_property_named_like_a_keyword_is_not_a_keyword(service):
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": [1]}}}
    grammar = grammar_of(service, StructuredOutputs(json=json.dumps(schema)))
    assert accepts(grammar, '{"not": 1, "if": 1}')


def test_a_slow_compile_fails_its_request_after_the_timeout(tiny_model):
    svc = GrammarService(tiny_model("llama"), VOCAB, max_spec_bytes=1 << 20, compile_timeout_s=0.05)
    # ~1 s to compile at this vocabulary: optional properties multiply the work.
    props = {f"p{i}": {"type": "integer"} for i in range(2500)}
    spec = StructuredOutputs(json=json.dumps({"type": "object", "properties": props}))
    ticket = svc.submit(spec, "slow")
    while not ticket.ready():
        GrammarService.wait_any([ticket], timeout=1.0)
    with pytest.raises(GrammarError, match=r"took longer than 0\.05 s"):
        ticket.grammar()
    svc.close()


# --- the service: cache ---


def test_the_same_constraint_compiles_once_and_shares_the_compiled_grammar(tiny_model):
    svc = GrammarService(
        tiny_model("llama"), VOCAB, eos_token_ids=[EOS], cache_size=2, max_threads=1
    )
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    # Hold the one compile thread, so that the compile of `a` is still queued when the
    # second request for it comes (a compile of "a+" can finish between two submits).
    gate = threading.Event()
    svc._pool.submit(gate.wait, 30)
    first, second = svc.submit(a), svc.submit(a)  # the second joins the compile in flight
    assert not second.ready() and svc.num_cache_hits == 0
    gate.set()
    assert first.wait(30) and second.wait(30)
    assert svc.num_compiled == 1 and svc.num_cache_hits == 0
    compiled = svc.compiled(a)
    third = svc.submit(StructuredOutputs(regex="a+", param="guided_regex"))
    assert third.ready() and svc.num_cache_hits == 1 and svc.compiled(a) is compiled
    g1, g2 = first.grammar(), third.grammar()
    assert g1.matcher is not g2.matcher  # each request its own state
    assert g1.accept(ord("a")) and g2.num_accepted == 0
    # Bounded LRU: touching `a` makes `b` the oldest, so `c` evicts `b`.
    for spec in (b, a, c):
        svc.submit(spec).wait(30)
    assert svc.compiled(b) is None and svc.compiled(a) is compiled and svc.compiled(c) is not None
    svc.close()


def test_the_service_refuses_other_backends(tiny_model):
    with pytest.raises(ValueError, match="backend 'outlines' is not supported"):
        GrammarService(tiny_model("llama"), VOCAB, backend="outlines")


# --- the matcher ---


def test_the_grammar_allows_only_eos_once_complete_and_terminates_on_it(service):
    grammar = grammar_of(service, StructuredOutputs(choice=["ab"]))
    assert allowed(grammar) == {ord("a")}
    assert grammar.accept(ord("a")) and grammar.accept(ord("b"))
    assert grammar.is_completed() and not grammar.is_terminated()
    assert allowed(grammar) == {EOS}
    assert not grammar.accept(ord("c"))  # refused, state unchanged
    assert grammar.accept(EOS) and grammar.is_terminated()


def test_special_and_padding_tokens_are_never_allowed_inside_the_text(service):
    grammar = grammar_of(service, StructuredOutputs(regex=r"[\s\S]{1,3}"))
    ids = allowed(grammar)
    assert set(range(128)) <= ids  # every ASCII byte (a continuation byte cannot start)
    assert ids.isdisjoint({256, 257, EOS, *range(259, VOCAB)})  # specials, padding rows


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(regex="."),
        StructuredOutputs(regex="[^a]"),
        StructuredOutputs(json='{"type": "string"}'),
        StructuredOutputs(json='{"type": "string", "maxLength": 2}'),
        StructuredOutputs(grammar="root ::= [^a]"),
        StructuredOutputs(grammar="start: /[^a]/"),
    ],
)
def test_no_constraint_lets_bytes_spell_a_surrogate_code_point(service, spec):
    # xgrammar's classes include U+D800-DFFF, whose UTF-8 form is invalid UTF-8.
    quote = b'"' if spec.json else b""
    for text in ("\ud7ff", "\ue000", "é"):  # neighbours of the surrogate block pass
        grammar = grammar_of(service, spec)
        assert all(grammar.accept(b) for b in quote + text.encode() + quote), text
    grammar = grammar_of(service, spec)
    assert all(grammar.accept(b) for b in quote + b"\xed")
    assert not grammar.accept(0xA0)  # ED A0..BF would spell U+D800..DFFF


def test_a_length_bounded_json_string_takes_no_raw_control_character(service):
    spec = StructuredOutputs(json='{"type": "string", "maxLength": 3}')
    assert accepts(grammar_of(service, spec), '"ab"')
    assert not accepts(grammar_of(service, spec), '"a\tb"')  # a raw tab: not JSON
    assert not accepts(grammar_of(service, spec), '"\x15"')


def test_rollback_forgets_accepted_tokens(service):
    grammar = grammar_of(service, StructuredOutputs(choice=["ab", "ac"]))
    assert grammar.accept(ord("a")) and grammar.accept(ord("b"))
    grammar.rollback(1)
    assert grammar.num_accepted == 1 and allowed(grammar) == {ord("b"), ord("c")}


# --- the step bitmask ---


def _random_grammars(service, n: int, seed: int) -> list[RequestGrammar]:
    spec = StructuredOutputs(json='{"type": "object", "properties": {"k": {"type": "string"}}}')
    text = '{"k": "value"}'
    grammars = []
    for i in range(n):
        grammar = grammar_of(service, spec)
        for b in text.encode()[: (seed + 3 * i) % len(text)]:
            assert grammar.accept(b)
        grammars.append(grammar)
    return grammars


@pytest.mark.parametrize("constrained", ["all", "most", "few", "none"])
def test_step_bitmask_masks_exactly_what_xgrammar_would_and_leaves_free_rows(service, constrained):
    rows = 40  # more than the bitmask's first size: it grows
    pick = {"all": lambda i: True, "most": lambda i: i % 4 != 0, "few": lambda i: i % 9 == 0}
    chosen = pick.get(constrained, lambda i: False)
    pool = _random_grammars(service, rows, seed=1)
    grammars = [g if chosen(i) else None for i, g in enumerate(pool)]
    torch.manual_seed(0)
    logits = torch.randn(rows, VOCAB)
    expected = logits.clone()
    reference = xgr.allocate_token_bitmask(rows, VOCAB)
    masked_rows = [i for i, g in enumerate(grammars) if g is not None]
    for i in masked_rows:
        grammars[i].fill_bitmask(reference, i)
    if masked_rows:
        xgr.apply_token_bitmask_inplace(expected, reference, vocab_size=VOCAB, indices=masked_rows)
    step = StepBitmask(VOCAB, max_rows=8)
    assert step.apply(logits, grammars) == masked_rows
    assert torch.equal(logits, expected)
    for i in range(rows):
        if i not in masked_rows:
            assert torch.isfinite(logits[i]).all()


def test_step_bitmask_skips_terminated_grammars(service):
    grammar = grammar_of(service, StructuredOutputs(choice=["a"]))
    assert grammar.accept(ord("a")) and grammar.accept(EOS)
    logits = torch.zeros(2, VOCAB)
    assert StepBitmask(VOCAB).apply(logits, [grammar, None]) == []
    assert torch.equal(logits, torch.zeros(2, VOCAB))


def test_step_bitmask_works_on_a_row_slice_of_a_larger_logits_tensor(service):
    grammar = grammar_of(service, StructuredOutputs(choice=["z"]))
    logits = torch.zeros(5, VOCAB)  # 2 sampling rows, then 3 prompt-logprob rows
    StepBitmask(VOCAB).apply(logits[:2], [None, grammar])
    assert torch.isfinite(logits[1]).sum() == 1 and logits[1, ord("z")] == 0
    assert torch.isfinite(logits[[0, 2, 3, 4]]).all()
