"""/openapi.json, generated from the route table and the pydantic request models
(never written by hand)."""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Protocol, get_args

from pydantic import BaseModel

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
}
_ERROR_RESPONSE = {
    "description": "invalid request",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}


class DocumentedRoute(Protocol):
    path: str
    methods: tuple[str, ...]
    body: object  # a request model, a union of them, or None


def build_openapi(routes: Iterable[DocumentedRoute], version: str, root_path: str = "") -> dict:
    """The document; behind a proxy (`--root-path`) it names the prefix as its server."""
    schemas: dict[str, dict] = {"ErrorResponse": _ERROR}
    paths: dict[str, dict] = {}
    for route in routes:
        operation_id = route.path.strip("/").replace("/", "_") or "root"
        operations = {}
        for method in route.methods:
            operation: dict = {
                "operationId": f"{operation_id}_{method.lower()}"
                if len(route.methods) > 1
                else operation_id,
                "responses": {"200": {"description": "OK"}},
            }
            if method == "POST" and route.body is not None:
                refs = [_add_schema(schemas, model) for model in _models(route.body)]
                schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
                operation["responses"] = {
                    "200": {"description": "JSON, or an SSE stream when stream is true"},
                    "400": _ERROR_RESPONSE,
                }
            operations[method.lower()] = operation
        paths[route.path] = operations
    document = {
        "openapi": "3.1.0",
        "info": {"title": "zserve", "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document


def _models(body: object) -> list[type[BaseModel]]:
    return list(get_args(body)) if isinstance(body, types.UnionType) else [body]


def _add_schema(schemas: dict[str, dict], model: type[BaseModel]) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        schemas[name] = sub
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}
