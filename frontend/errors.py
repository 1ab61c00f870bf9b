"""Errors as values at the HTTP boundary: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging

import orjson
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger("zserve.api")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes a JSON error response (or SSE error event)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.type = type_  # None: the status's (_TYPES)

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.type)


# Retry-After of a request refused because the engines sleep (sleep mode).
ASLEEP_RETRY_AFTER_S = 5


def asleep_error(message: str) -> APIError:
    """A 503 for a request the engines cannot take while asleep: worth retrying."""
    return APIError(message, 503, headers={"Retry-After": str(ASLEEP_RETRY_AFTER_S)})


def error_body(
    message: str, status: int, param: str | None = None, type_: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    message: str,
    status: int,
    param: str | None = None,
    headers: dict | None = None,
    type_: str | None = None,
) -> Response:
    return Response(
        orjson.dumps(error_body(message, status, param, type_)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def handle_api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc.message, exc.status, exc.param, exc.headers, exc.type)


async def handle_http_exception(request: Request, exc) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    if status == 404:
        detail = f"route {request.method} {request.url.path} not found"
    return error_response(str(detail), status, headers=getattr(exc, "headers", None))


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Whatever went wrong is logged with the request id; the client learns nothing of
    the code that failed."""
    rid = request.headers.get("x-request-id", "-")[:256]
    log.exception("internal error on %s (request id %s)", request.url.path[:256], rid)
    return error_response("internal server error", 500)


def listing(items: list, limit: int = 20) -> str:
    """The first `limit` items for an error message, and how many more there are: a
    hostile request may hold thousands of bad values, its error stays short."""
    shown = ", ".join(repr(i) for i in items[:limit])
    return f"[{shown}]" if len(items) <= limit else f"[{shown}, … and {len(items) - limit} more]"
