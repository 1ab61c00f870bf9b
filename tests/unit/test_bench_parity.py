"""`zserve bench parity` compares answers, not texts: what it counts as a difference."""

from __future__ import annotations

from benchmarks.parity import Answer, _shape, _stream_shape, differences
from benchmarks.parity_cases import DEFAULT, FLAGS


def answer(doc: dict, status: int = 200, value=None) -> Answer:
    error = doc.get("error")
    error = (error["type"], error["param"]) if isinstance(error, dict) else None
    return Answer(status, _shape(doc), error, value)


def test_vllm_only_fields_are_no_difference_but_missing_ones_are():
    ours = {"id": "x", "choices": [{"index": 0, "text": "a"}], "usage": {"prompt_tokens": 1}}
    theirs = {**ours, "service_tier": None, "kv_transfer_params": None}
    assert differences(answer(ours), answer(theirs)) == []
    theirs["choices"] = [{"index": 0, "text": "b", "stop_reason": None}]
    assert differences(answer(ours), answer(theirs)) == ["choice: +A[] +B['stop_reason']"]


def test_status_error_param_type_and_probed_values_are_compared():
    a = answer({"error": {"type": "BadRequestError", "param": "n"}}, 400, value=3)
    b = answer({"error": {"type": "Bad Request", "param": None}}, 422, value=4)
    assert differences(a, b) == [
        "status 400 vs 422",
        "param 'n' vs None",
        "type 'BadRequestError' vs 'Bad Request'",
        "value 3 vs 4",
    ]


def test_a_stream_is_compared_by_its_first_middle_and_last_chunks():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    token = {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 1}}
    shape = _stream_shape([role, token, usage])
    assert shape["first.delta"] == ["role"] and shape["mid.choice"] == [
        "delta",
        "index",
        "token_ids",
    ]
    assert shape["last.usage"] == ["prompt_tokens"]


def test_every_case_names_its_item_and_a_distinct_name():
    for cases in (DEFAULT, FLAGS):
        assert len({c.name for c in cases}) == len(cases)
        assert all(c.item == "-" or c.item.isdigit() for c in cases)
    items = {c.item for c in DEFAULT + FLAGS} - {"-"}
    assert items == {str(i) for i in range(1, 21)} - {"13"}  # beam search is another issue's
