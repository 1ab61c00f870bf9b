"""The structured-output load: a JSON schema on a share of the requests.

`--structured-output-ratio R` constrains that share of the prompts (chosen by the seed)
to a JSON schema, sent in the field vLLM and zserve both take (`structured_outputs.json`
by default; `response_format` or the legacy `guided_json` on request). A constrained
request lets the schema decide its length (its `ignore_eos` is off; max_tokens stays a cap).
`--structured-output-unique-schemas` gives each constrained request its own schema (a
distinct `title`), so every one is compiled: time to first token then includes the
compile; otherwise one schema is compiled once and then served from the cache.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any

from benchmarks.datasets import SampleRequest

FIELDS = ("structured_outputs", "response_format", "guided_json")

# Bounded everywhere, so a random model's documents end within ~60-100 tokens.
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "minLength": 3, "maxLength": 12},
        "email": {"type": "string", "maxLength": 16},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["id", "name", "email", "tags", "active", "role"],
}


@dataclass(frozen=True)
class StructuredLoad:
    ratio: float = 0.0
    schema: dict[str, Any] = field(default_factory=lambda: DEFAULT_SCHEMA)
    unique_schemas: bool = False
    field: str = "structured_outputs"


def load_schema(path: str | None) -> dict[str, Any]:
    """The schema at `path` (a JSON file), or the default one."""
    if not path:
        return DEFAULT_SCHEMA
    with open(path, encoding="utf-8") as f:
        schema = json.load(f)
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a JSON schema must be an object")
    return schema


def body_fields(schema: dict[str, Any], field_name: str) -> dict[str, Any]:
    """The request fields that ask for `schema`."""
    if field_name == "structured_outputs":
        constraint: dict[str, Any] = {"structured_outputs": {"json": schema}}
    elif field_name == "response_format":
        constraint = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema},
            }
        }
    elif field_name == "guided_json":
        constraint = {"guided_json": schema}
    else:
        raise ValueError(f"unknown structured-output field {field_name!r}; one of {FIELDS}")
    return {**constraint, "ignore_eos": False}


def constrain(
    requests: list[SampleRequest], load: StructuredLoad, seed: int
) -> list[SampleRequest]:
    """`requests` with `load.ratio` of them (picked by `seed`) carrying the schema."""
    if not 0.0 <= load.ratio <= 1.0:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {load.ratio}")
    count = round(load.ratio * len(requests))
    if not count:
        return requests
    picked = random.Random(seed + 1).sample(range(len(requests)), count)
    out = list(requests)
    for n, i in enumerate(sorted(picked)):
        schema = load.schema
        if load.unique_schemas:
            schema = {**schema, "title": f"bench-{seed}-{n}"}
        out[i] = dataclasses.replace(out[i], extra=body_fields(schema, load.field))
    return out


def valid_documents(requests: list[SampleRequest], texts: list[str | None]) -> tuple[int, int]:
    """(constrained requests whose text parses as JSON, constrained requests that ran)."""
    valid = ran = 0
    for req, text in zip(requests, texts):
        if not req.extra or text is None:
            continue
        ran += 1
        try:
            json.loads(text)
            valid += 1
        except ValueError:
            pass
    return valid, ran
