"""The limit for zserve's HTTP stack: a bare Starlette + uvicorn (uvloop, httptools)
server whose /v1/completions streams `max_tokens` chunks shaped like zserve's, with
no engine, no tokenizer, no model. `zserve bench frontend` measures it beside zserve.

    python -m benchmarks.bare_sse --port 18300
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "bare-sse"


async def completions(request: Request) -> StreamingResponse:
    body = orjson.loads(await request.body())
    n = int(body.get("max_tokens") or 16)
    created = int(time.time())

    async def events():
        for i in range(n):
            chunk = {
                "id": "cmpl-bare",
                "object": "text_completion",
                "created": created,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": " x",
                        "logprobs": None,
                        "finish_reason": "length" if i == n - 1 else None,
                        "stop_reason": None,
                    }
                ],
                "usage": None,
            }
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            await asyncio.sleep(0)  # one event per loop turn, as an engine-fed stream
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        yield (
            b"data: "
            + orjson.dumps(
                {
                    "id": "cmpl-bare",
                    "object": "text_completion",
                    "created": created,
                    "model": MODEL,
                    "choices": [],
                    "usage": usage,
                }
            )
            + b"\n\n"
        )
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


app = Starlette(
    routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18300)
    args = parser.parse_args()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
