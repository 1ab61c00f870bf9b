"""/openapi.json, generated from the pydantic request models (never written by hand)."""

from __future__ import annotations

from pydantic import BaseModel

from frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

POST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
GET_ROUTES = [
    "/v1/models",
    "/health",
    "/live",
    "/ping",
    "/load",
    "/version",
    "/metrics",
    "/server_info",
]

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


def build_openapi(version: str, root_path: str = "") -> dict:
    """The document; behind a proxy (`--root-path`) it names the prefix as its server."""
    schemas: dict[str, dict] = {"ErrorResponse": _ERROR}
    paths: dict[str, dict] = {}
    for path, model in POST_BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            schemas[name] = sub
        schemas[model.__name__] = schema
        paths[path] = {
            "post": {
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                        }
                    },
                },
                "responses": {
                    "200": {"description": "JSON, or an SSE stream when stream is true"},
                    "400": {
                        "description": "invalid request",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                            }
                        },
                    },
                },
            }
        }
    for path in GET_ROUTES:
        paths[path] = {
            "get": {
                "operationId": path.strip("/").replace("/", "_") or "root",
                "responses": {"200": {"description": "OK"}},
            }
        }
    document = {
        "openapi": "3.1.0",
        "info": {"title": "zserve", "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document
