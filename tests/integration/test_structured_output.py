"""Structured outputs on a real tiny engine, in-process through `LLM` (random weights: the
constraint alone decides whether the text is well formed): grammars compiled off the step,
masks applied in EngineCore.step, tokens accepted in the scheduler's update."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from engine_oracle import SMALL_KV
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.config import GrammarConfig
from engine_core.llm import LLM
from protocol.messages import FinishReason, SamplingParams, StructuredOutputs

pytestmark = pytest.mark.timeout(180)

EOS = 258  # the tiny models' <|im_end|>
PROMPTS = [[72, 105, 33], [10, 20, 30, 40, 50, 60], [200, 1, 99]]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age"],
}
ARITHMETIC = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'
ARITHMETIC_RE = re.compile(r"[0-9()+]+")
LARK = 'start: pair ("," pair)?\npair: KEY "=" VALUE\nKEY: /[a-c]/\nVALUE: /[0-9]{1,2}/'
STRUCTURAL_TAG = json.dumps(
    {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "<n>"},
                {"type": "json_schema", "json_schema": {"type": "integer", "maximum": 9}},
                {"type": "const_string", "value": "</n>"},
            ],
        },
    }
)


def text_of(result) -> str:
    """The generated text: byte tokens up to the EOS that ended the constraint."""
    assert result.error is None, result.error
    assert result.finish_reason == FinishReason.STOP, result.token_ids
    assert result.token_ids[-1] == EOS and all(t < 256 for t in result.token_ids[:-1])
    return bytes(result.token_ids[:-1]).decode("utf-8")


def check(kind: str, spec: StructuredOutputs, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(spec.regex, text), text
    elif kind == "choice":
        assert text in spec.choice
    elif kind == "ebnf":
        assert ARITHMETIC_RE.fullmatch(text) and text.count("(") == text.count(")")
        eval(text)  # balanced, well-formed arithmetic over digits  # noqa: S307
    elif kind == "lark":
        assert re.fullmatch(r"[a-c]=[0-9]{1,2}(,[a-c]=[0-9]{1,2})?", text), text
    elif kind == "structural_tag":
        assert re.fullmatch(r"<n>\s*-?[0-9]+\s*</n>", text), text
        assert int(text[3:-4]) <= 9


CLOSERS = {ord('"'): 4.0, ord("}"): 4.0, ord("]"): 4.0}
KINDS = {
    "json": StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[A-Z][a-z]{1,4}-\d{2,3}"),
    "choice": StructuredOutputs(choice=["yes", "no", "it depends"]),
    "ebnf": StructuredOutputs(grammar=ARITHMETIC),
    "lark": StructuredOutputs(grammar=LARK),
    "structural_tag": StructuredOutputs(structural_tag=STRUCTURAL_TAG),
}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV)


def run(llm, prompts, params):
    results = llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    return results


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2), (0.7, 3)])
def test_every_kind_of_constraint_yields_text_that_parses_and_validates(llm, temperature, seed):
    kinds = list(KINDS)
    params = [
        SamplingParams(
            max_tokens=160,
            temperature=temperature,
            seed=seed,
            structured_outputs=spec,
            # Nothing bounds a json_object: make closing quotes and brackets likely.
            logit_bias=CLOSERS if kind == "json_object" else None,
        )
        for kind, spec in KINDS.items()
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    for kind, result in zip(kinds, run(llm, prompts, params)):
        check(kind, KINDS[kind], text_of(result))  # ends on EOS: the grammar terminated


def test_the_cpu_kernels_draw_never_picks_a_masked_token(tiny_model):
    # bf16 on the native forward: the sampler draws with the kernels' softmax_draw.
    llm = LLM(
        str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV, dtype="bfloat16", device="cpu"
    )
    assert llm.engine.sampler.kernels is not None
    kinds = ["json", "regex", "choice", "ebnf"]
    params = [
        SamplingParams(max_tokens=160, temperature=t, seed=s, structured_outputs=KINDS[kind])
        for kind in kinds
        for t, s in ((1.0, 4), (1.5, 5))
    ]
    results = run(llm, [PROMPTS[i % 3] for i in range(len(params))], params)
    for kind, result in zip([k for k in kinds for _ in (0, 1)], results):
        check(kind, KINDS[kind], text_of(result))


def test_rows_without_a_constraint_are_untouched_by_constrained_neighbours(llm):
    free = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=12, ignore_eos=True),
    ]
    alone = [r.token_ids for r in run(llm, PROMPTS, free)]
    constrained = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=5, structured_outputs=s)
        for s in (KINDS["regex"], KINDS["json"], KINDS["choice"])
    ]
    mixed = run(
        llm,
        [p for p in PROMPTS for _ in (0, 1)],
        [x for pair in zip(free, constrained) for x in pair],
    )
    assert [r.token_ids for r in mixed[0::2]] == alone
    for kind, result in zip(("regex", "json", "choice"), mixed[1::2]):
        check(kind, KINDS[kind], text_of(result))


def test_logprobs_are_those_of_the_masked_distribution(llm):
    spec = StructuredOutputs(choice=["yes", "no"])
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, structured_outputs=spec)
    (result,) = run(llm, [PROMPTS[0]], params)
    text = text_of(result)
    assert text in ("yes", "no")
    first_ids, first_lps = result.logprobs.token_ids[0], result.logprobs.logprobs[0]
    finite = {t: lp for t, lp in zip(first_ids[1:], first_lps[1:]) if lp != float("-inf")}
    assert set(finite) == {ord("y"), ord("n")}  # the only tokens the grammar allows first
    assert sum(math.exp(lp) for lp in finite.values()) == pytest.approx(1)
    assert result.logprobs.ranks[0] == 1  # greedy over the masked distribution
    for row in result.logprobs.logprobs[1:]:
        assert row[0] == pytest.approx(0.0, abs=1e-6)  # one allowed token: certain


def test_a_preempted_request_resumes_its_grammar_where_it_stopped(tiny_model):
    # 12 blocks of 16 tokens for 6 requests of up to 3 + 120 tokens: preemption is certain.
    llm = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=12 * 8192, max_num_seqs=6)
    roomy = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV)
    spec = StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
    prompts = [PROMPTS[i % 3] + [i] for i in range(6)]
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(6)
    ]
    squeezed = run(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for result, reference in zip(squeezed, run(roomy, prompts, params)):
        check("json", spec, text_of(result))
        assert result.token_ids == reference.token_ids


def test_a_bad_constraint_ends_only_its_own_request_with_a_message_naming_the_field(tiny_model):
    llm = LLM(
        str(tiny_model("llama")),
        grammar=GrammarConfig(max_spec_bytes=4096),
        kv_cache_memory_bytes=SMALL_KV,
    )
    bad = [
        (StructuredOutputs(regex="[.*"), "structured_outputs.regex: Regex parsing error"),
        (
            StructuredOutputs(json='{"type": "bogus"}', param="response_format.json_schema"),
            "response_format.json_schema: Unsupported type",
        ),
        (StructuredOutputs(grammar="root ::= " + '"a" | ' * 1000 + '"b"'), "the limit is 4096"),
        (StructuredOutputs(), "set exactly one of"),
    ]
    good = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=KINDS["regex"])
    params = [SamplingParams(max_tokens=40, structured_outputs=s) for s, _ in bad] + [good]
    results = run(llm, [PROMPTS[0]] * len(params), params)
    for (_, message), result in zip(bad, results):
        assert result.finish_reason == FinishReason.REFUSED and result.token_ids == []
        assert message in result.error
    check("regex", KINDS["regex"], text_of(results[-1]))


def test_requests_sharing_a_constraint_share_one_compile(tiny_model):
    llm = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV)
    spec = StructuredOutputs(regex=r"[a-z]{2,6}")
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(4)
    ]
    for result in run(llm, PROMPTS[:2] * 2, params):
        check("regex", spec, text_of(result))
    run(llm, [PROMPTS[2]], params[0])
    service = llm.engine.grammars.service
    assert service.num_compiled == 1 and service.num_cache_hits >= 1


# Bounded schemas: every string, array and number has a length or range limit, so a
# random model cannot run out of tokens inside one.
_names = st.sampled_from(["a", "b", "id", "name", "x_1", "ключ", "emoji🎉"])
_words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=3)
_leaves = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-999, 999), st.integers(0, 2000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.integers(1, 3).map(lambda n: {"type": "string", "minLength": n, "maxLength": n + 1}),
    st.lists(_words | st.integers(-9, 9) | st.booleans(), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
    _words.map(lambda w: {"const": w}),
    st.sampled_from([{"type": "string", "pattern": "^[a-c]{1,3}$"}]),
)


def _objects(children):
    def build(props):
        return (
            st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda required: {"type": "object", "properties": props, "required": required}
            )
            if props
            else st.just({"type": "object", "properties": {}})
        )

    return st.dictionaries(_names, children, max_size=3).flatmap(build)


_schemas = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
        ),
        _objects(children),
        st.lists(children, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}),
    ),
    max_leaves=5,
)


@settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schemas=st.lists(_schemas, min_size=3, max_size=3), seed=st.integers(0, 1000))
def test_generated_json_schemas_yield_documents_that_validate(llm, schemas, seed):
    specs = [StructuredOutputs(json=json.dumps(s), disable_any_whitespace=True) for s in schemas]
    params = [
        SamplingParams(max_tokens=400, temperature=t, seed=seed, structured_outputs=s)
        for s in specs
        for t in (0.0, 1.0)
    ]
    results = run(llm, [PROMPTS[i % 3] for i in range(len(params))], params)
    for spec, result in zip([s for s in specs for _ in (0, 1)], results):
        check("json", spec, text_of(result))


def test_a_constraint_after_reasoning_leaves_the_reasoning_free_and_binds_the_answer(llm):
    # The end of "reasoning" is a token the model writes by itself after a few others:
    # up to it the constrained output equals the free one, after it the grammar rules.
    for prompt in PROMPTS:
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        (free,) = run(llm, [prompt], greedy)
        k = next(i for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
        end = free.token_ids[k]
        spec = StructuredOutputs(regex=r"[0-9]{3}", reasoning_end_ids=[end])
        params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec)
        (result,) = run(llm, [prompt], params)
        ids = result.token_ids
        assert result.finish_reason == FinishReason.STOP and ids[-1] == EOS, ids
        assert ids[: k + 1] == free.token_ids[: k + 1]
        assert re.fullmatch(r"[0-9]{3}", bytes(ids[k + 1 : -1]).decode()), ids


def test_a_multi_token_reasoning_end_in_the_output_starts_the_constraint():
    from engine_core.grammar_matcher import Constraint

    class Free:
        def accept(self, token):
            return token != -1

        def is_terminated(self):
            return False

    c = Constraint(Free(), [7, 8, 9])
    for token in (7, 8, 1, 7, 8):
        assert c.accept(token) and not c.active
    assert c.accept(9) and c.active
    assert not c.accept(-1)  # now the grammar decides


def test_a_complete_constraint_wins_over_min_tokens(llm):
    params = SamplingParams(
        max_tokens=50, min_tokens=40, temperature=1.0, seed=3, structured_outputs=KINDS["choice"]
    )
    (result,) = run(llm, [PROMPTS[0]], params)
    assert text_of(result) in KINDS["choice"].choice


def test_a_constraint_the_other_parameters_leave_no_token_for_is_refused(llm):
    spec = StructuredOutputs(regex="[0-9]+")
    params = [
        SamplingParams(max_tokens=10, allowed_token_ids=[ord("a")], structured_outputs=spec),
        SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=spec),
    ]
    bad, good = run(llm, [PROMPTS[0], PROMPTS[1]], params)
    assert bad.finish_reason == FinishReason.REFUSED and bad.token_ids == []
    assert bad.error.startswith("structured_outputs:") and "allowed_token_ids" in bad.error
    assert good.error is None and good.token_ids  # its neighbour ran on


def test_a_parked_request_counts_as_waiting_and_an_abort_removes_it(tiny_model):
    from protocol.messages import EngineCoreRequest, now

    llm = LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV)
    engine = llm.engine
    spec = StructuredOutputs(json=json.dumps(PERSON))
    request = EngineCoreRequest(
        "parked", PROMPTS[0], SamplingParams(structured_outputs=spec), arrival_time=now()
    )
    assert engine.add_request(request) == []
    assert engine.has_unfinished_requests() and engine.make_stats().num_waiting == 1
    engine.abort_requests(["parked"])
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.make_stats().num_waiting == 0
    engine.grammars.service._pool.shutdown(wait=True)  # the compile ran on, unharmed
    assert engine.step() == {}


def test_chunked_prefill_and_prefix_hits_leave_constrained_output_unchanged(tiny_model):
    model = str(tiny_model("llama"))
    chunked = LLM(model, kv_cache_memory_bytes=SMALL_KV, max_num_batched_tokens=16)
    whole = LLM(model, kv_cache_memory_bytes=SMALL_KV, enable_prefix_caching=False)
    prompt = list(range(40, 120))
    spec = StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=spec)
        for s in range(3)
    ]
    reference = [r.token_ids for r in run(whole, [prompt] * 3, params)]
    for _ in range(2):  # the second round hits the prefix cache
        assert [r.token_ids for r in run(chunked, [prompt] * 3, params)] == reference
    assert chunked.engine.blocks.prefix_cache_hits > 0
    for ids in reference:
        jsonschema.validate(json.loads(bytes(ids[:-1]).decode()), PERSON)
