"""One streamed OpenAI request, timed chunk by chunk (aiohttp; SSE parsed by hand).

aiohttp rather than httpx: on this 2-core machine httpx's client spent 70–220 µs of CPU
per SSE chunk (growing with concurrency), aiohttp 14–22 µs; the load generator shares
the cores with the server it measures, so its own cost must stay small.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.datasets import SampleRequest

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the URL, the request body's fixed fields, the headers."""

    api_url: str
    model: str
    chat: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body(self, req: SampleRequest) -> bytes:
        payload: dict[str, Any] = {
            "model": req.model or self.model,
            "max_tokens": req.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            payload["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            payload["prompt"] = req.prompt
        if self.ignore_eos:
            payload["ignore_eos"] = True
        if self.temperature is not None:
            payload["temperature"] = self.temperature
        payload.update(self.extra_body)
        if req.extra:
            payload.update(req.extra)
        return orjson.dumps(payload)


@dataclass
class RequestResult:
    """What one request did. Times are seconds; start_time is relative to the run's start.

    TTFT is the first chunk that carries generated text (a chat role-only chunk is not a
    token), ITLs are the gaps between consecutive such chunks, latency ends at the last."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int | None = None  # from the server's usage; None until counted
    usage_reported: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""

    @property
    def num_chunks(self) -> int:
        return len(self.itl) + 1 if self.success else 0


def _chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    """Generated text in one stream chunk; None when the chunk has no choice."""
    choices = data.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if text:
        return text
    return " " if delta.get("tool_calls") else ""


def _events(buf: bytearray) -> list[bytes]:
    """Pop every complete SSE event's data from `buf` (comments and other fields dropped)."""
    out = []
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return out
        event = bytes(buf[:end])
        del buf[: end + 2]
        data = [
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        ]
        if data:
            out.append(b"\n".join(data))


async def send_request(
    session: aiohttp.ClientSession, endpoint: Endpoint, req: SampleRequest, t0: float
) -> RequestResult:
    """Send one streaming request and time its chunks. Never raises: a failure is a result."""
    result = RequestResult(prompt_len=req.prompt_len)
    texts: list[str] = []
    first_choice = last_choice = 0.0  # any choice chunk, for a stream of only empty texts
    last = st = time.perf_counter()
    result.start_time = st - t0
    try:
        async with session.post(
            endpoint.api_url, data=endpoint.body(req), headers=endpoint.headers
        ) as resp:
            if resp.status != 200:
                body = (await resp.text(errors="replace"))[:1000]
                result.error = f"HTTP {resp.status}: {body}"
                return result
            buf = bytearray()
            # Hot path: one pass per network read; every event in a read shares its time.
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                for payload in _events(buf):
                    if payload == b"[DONE]":
                        continue
                    chunk = orjson.loads(payload)
                    if "error" in chunk:
                        err = chunk["error"]
                        result.error = str(
                            err.get("message", err) if isinstance(err, dict) else err
                        )
                        return result
                    usage = chunk.get("usage")
                    if usage:
                        result.output_tokens = usage.get("completion_tokens")
                        result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
                        result.usage_reported = result.output_tokens is not None
                    text = _chunk_text(chunk, endpoint.chat)
                    if text is None:
                        continue
                    first_choice = first_choice or now
                    last_choice = now
                    if not text:
                        continue
                    if texts:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - st
                    last = now
                    texts.append(text)
    except Exception as e:  # noqa: BLE001 - a failed request is data, whatever failed
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return result
    if not texts and first_choice:
        # Only empty texts (tokens that detokenize to nothing): time the choice chunks.
        result.ttft, last = first_choice - st, last_choice
    elif not texts:
        result.error = "the stream ended without any generated chunk"
        return result
    result.latency = last - st
    result.generated_text = "".join(texts)
    result.success = True
    return result


async def list_models(base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """GET /v1/models: what `--model` (its id) and `--tokenizer` (its root) default to."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp,
    ):
        resp.raise_for_status()
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models
