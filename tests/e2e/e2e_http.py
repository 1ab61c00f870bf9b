"""What the OpenAI-surface e2e tests share: clients for a running server, SSE parsing,
the error-body check and small readers of /server_info and /metrics."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
from zserve_proc import ZServe, wait_for

MODEL = "tiny"
ALIAS = "tiny-alias"
SERVED_NAMES = ("--served-model-name", MODEL, ALIAS)
# On CPU everywhere: the waits some tests build need an engine of the CI box's speed.
SMALL_KV = ("--kv-cache-memory-bytes", "64MiB", "--device", "cpu")
VOCAB_SIZE = 320
MAX_MODEL_LEN = 1024
EOS = 258
IM_START = 257
# The tool the tool-calling tests offer, in whichever API's wrapping, and the Hermes
# call the model is made to write (a regex constraint) when it chooses the tool itself.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
HERMES = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "unit": "C"\}\}\n</tool_call>'


def sync_client(server: ZServe, api_key: str = "none", **kwargs) -> openai.OpenAI:
    kwargs = {"max_retries": 0, "timeout": 60, **kwargs}
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, **kwargs)


def async_client(server: ZServe, api_key: str = "none", **kwargs) -> openai.AsyncOpenAI:
    kwargs = {"max_retries": 0, "timeout": 60, **kwargs}
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=api_key, **kwargs)


def http_client(server: ZServe, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60, **kwargs)


@dataclass
class SSE:
    """A stream as it went over the wire: data payloads (parsed), comments, and whether
    it ended with `data: [DONE]`."""

    events: list[dict]
    comments: list[str]
    done: bool
    raw: str


def parse_sse(text: str) -> SSE:
    """Every event must be one `data:` line followed by a blank line (or a comment)."""
    events, comments, done = [], [], False
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-80:]!r}"
    for block in text.split("\n\n")[:-1]:
        assert "\n" not in block, f"an event spans several lines: {block!r}"
        assert not done, "something came after data: [DONE]"
        if block.startswith(":"):
            comments.append(block[1:].strip())
        elif block == "data: [DONE]":
            done = True
        else:
            assert block.startswith("data: "), f"not an SSE data line: {block!r}"
            events.append(orjson.loads(block[len("data: ") :]))
    return SSE(events, comments, done, text)


def named_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The payloads of a stream whose events are named, as the Responses and Messages
    APIs send them (parse_named_sse)."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_named_sse(r.read().decode())


def parse_named_sse(text: str) -> list[dict]:
    """Every event must be an `event: TYPE` line, then one `data:` line whose JSON says
    the same type, then a blank line (or be a comment)."""
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-80:]!r}"
    payloads = []
    for block in text.split("\n\n")[:-1]:
        if block.startswith(":"):  # a keep-alive comment
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        assert "\n" not in data, f"an event spans several lines: {block!r}"
        payload = orjson.loads(data[len("data: ") :])
        assert payload["type"] == name[len("event: ") :], block
        payloads.append(payload)
    return payloads


def post_stream(http: httpx.Client, path: str, body: dict, **kwargs) -> tuple[httpx.Response, SSE]:
    with http.stream("POST", path, json={**body, "stream": True}, **kwargs) as r:
        text = r.read().decode()
    if r.status_code != 200:
        return r, SSE([], [], False, text)
    assert r.headers["content-type"].startswith("text/event-stream")
    return r, parse_sse(text)


def assert_error(
    r: httpx.Response,
    status: int | Iterable[int],
    param: str | None | object = ...,
    contains: Iterable[str] = (),
) -> dict:
    """`r` is an error response with vLLM's body {"error": {message, type, param, code}}."""
    statuses = {status} if isinstance(status, int) else set(status)
    assert r.status_code in statuses, (r.status_code, r.text[:1000])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = assert_error_body(r.json(), r.status_code)
    if param is not ...:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error


def assert_error_body(body: object, status: int) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == status, error
    assert "Traceback" not in error["message"], error
    return error


def engine_stats(server: ZServe, headers: dict | None = None) -> dict:
    info = httpx.get(server.base_url + "/server_info", headers=headers, timeout=10).json()
    return info["engines"][0]["stats"]


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text → {name{labels}: value}, and the label-free sums {name: total}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        samples[key] = float(value)
        name = key.split("{", 1)[0]
        if "{" in key:
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def raw_exchange(server: ZServe, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send raw bytes, return everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def rss(server: ZServe) -> dict[str, int]:
    """Resident bytes of the API servers and engines (by process name), with the
    tokenizer workers counted with the API servers they serve."""
    sizes: dict[str, int] = {}
    for pid in server.pids():
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found = re.search(r"VmRSS:\s+(\d+)", status)
        if found is None:  # exiting (a tokenizer worker being replaced)
            continue
        kib = int(found.group(1))
        role = "tokenizers" if name == "zserve-tokenize" else name
        if role.startswith(("zserve-api", "zserve-engine")) or role == "tokenizers":
            sizes[role] = sizes.get(role, 0) + kib * 1024
    return sizes


def post_while_probing(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST `body`; meanwhile /health answers every probe within 5 s."""
    answers = []
    worker = threading.Thread(target=lambda: answers.append(http.post(path, json=body)))
    worker.start()
    while worker.is_alive():
        start = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - start < 5.0
        time.sleep(0.2)
    worker.join()
    return answers[0]


def assert_memory_returns(server: ZServe, baseline: dict[str, int], what: str = "") -> None:
    """Each process's resident memory comes back to within 50 MB of `baseline` (rss())."""
    limit = 50 * 1000 * 1000

    def settled() -> bool:
        now = rss(server)
        return all(now.get(role, 0) - size < limit for role, size in baseline.items())

    wait_for(settled, timeout=30, interval=1, what=what or f"memory to return from {baseline}")
