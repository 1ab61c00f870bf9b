"""`zserve bench serve`'s structured-output load: which requests carry a schema, in which
field, and how their responses are counted."""

from __future__ import annotations

import json

import orjson
import pytest

from benchmarks.client import Endpoint
from benchmarks.datasets import SampleRequest
from benchmarks.structured_load import (
    DEFAULT_SCHEMA,
    StructuredLoad,
    body_fields,
    constrain,
    valid_documents,
)

REQUESTS = [SampleRequest(f"p{i}", 3, 64) for i in range(10)]


def test_the_ratio_picks_that_share_of_requests_by_seed():
    out = constrain(REQUESTS, StructuredLoad(ratio=0.3), seed=1)
    picked = [i for i, r in enumerate(out) if r.extra]
    assert len(picked) == 3 and [r.prompt for r in out] == [r.prompt for r in REQUESTS]
    assert picked == [
        i for i, r in enumerate(constrain(REQUESTS, StructuredLoad(0.3), 1)) if r.extra
    ]
    assert picked != [
        i for i, r in enumerate(constrain(REQUESTS, StructuredLoad(0.3), 2)) if r.extra
    ]
    assert constrain(REQUESTS, StructuredLoad(ratio=0.0), seed=1) == REQUESTS
    with pytest.raises(ValueError, match="ratio"):
        constrain(REQUESTS, StructuredLoad(ratio=1.5), seed=1)


def test_unique_schemas_differ_only_in_title_and_a_shared_schema_is_one():
    shared = constrain(REQUESTS, StructuredLoad(ratio=1.0), seed=0)
    assert len({json.dumps(r.extra) for r in shared}) == 1
    unique = constrain(REQUESTS, StructuredLoad(ratio=1.0, unique_schemas=True), seed=0)
    schemas = [r.extra["structured_outputs"]["json"] for r in unique]
    assert len({s["title"] for s in schemas}) == len(REQUESTS)
    assert all({k: v for k, v in s.items() if k != "title"} == DEFAULT_SCHEMA for s in schemas)


@pytest.mark.parametrize("field", ["structured_outputs", "response_format", "guided_json"])
def test_a_constrained_request_body_carries_the_schema_and_lets_it_end_the_text(field):
    req = constrain(REQUESTS[:1], StructuredLoad(ratio=1.0, field=field), seed=0)[0]
    endpoint = Endpoint("http://x/v1/completions", "m", ignore_eos=True)
    body = orjson.loads(endpoint.body(req))
    assert body["ignore_eos"] is False and body["max_tokens"] == 64
    assert body[field] == body_fields(DEFAULT_SCHEMA, field)[field]
    assert orjson.loads(endpoint.body(REQUESTS[0]))["ignore_eos"] is True


def test_responses_of_constrained_requests_are_counted_as_json_documents():
    reqs = constrain(REQUESTS[:4], StructuredLoad(ratio=1.0), seed=0) + REQUESTS[:1]
    texts = ['{"a": 1}', "[1]", "{", None, '{"free": 1}']
    assert valid_documents(reqs, texts) == (2, 3)  # the failed one and the free one not counted
