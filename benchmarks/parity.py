"""`zserve bench parity`: the same requests to two OpenAI-compatible servers (zserve and
vLLM), and where their answers differ: status codes, the field sets of responses and
stream chunks, error types and params, and a few counts that do not depend on the
sampled text (usage, token ids, logprob list sizes).

The cases follow issue 16's items and assume the peers' model (../shared/peers: the
tiny llama, vocabulary 8192, --max-model-len 2048). Start both servers on it with the
same flags; each profile names the flags its cases need:

    default: --root-path /llm --enable-prompt-tokens-details
    flags:   --max-logprobs -1 --return-tokens-as-token-ids --enable-force-include-usage
             --api-key KEY   (pass --api-key KEY here too; zserve's key also guards
             /tokenize, /detokenize, /invocations and /load unless it is given
             --api-key-open-paths vllm: a deliberate difference)
    scale-out: --enable-scale-out   (render, generate, derender)
    pooling: --runner pooling   (/v1/embeddings, /pooling)

    zserve bench parity --base-url-a http://127.0.0.1:8000 --base-url-b http://127.0.0.1:8001
    python -m benchmarks.parity --profile flags --api-key KEY --base-url-a … --base-url-b …
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks import parity_pooling
from benchmarks.parity_cases import PROFILES as GENERATING
from benchmarks.parity_cases import Case, sent_keys

PROFILES = {**GENERATING, **parity_pooling.PROFILES}


@dataclass
class Answer:
    status: int
    shape: dict[str, list[str]]
    error: tuple[Any, Any] | None  # (type, param)
    value: Any = None
    note: str = ""


METRIC_NAMES = (
    "num_requests_waiting_by_reason",
    "admission_rejections_total",
    "request_num_preemptions_bucket",
    "num_requests_waiting",
    "num_preemptions_total",
)


# --- asking and comparing -------------------------------------------------------------


def ask(client: httpx.Client, case: Case, model: str, api_key: str | None) -> Answer:
    headers = dict(case.headers)
    if api_key and case.auth:
        headers["Authorization"] = f"Bearer {api_key}"
    body = case.body
    generation = ("completions", "batch", "responses", "messages", "count_tokens", "render")
    if body is not None and case.path.endswith(generation) and "model" not in body:
        body = {"model": model, **body}
    r = client.request(case.method, case.path, json=body, headers=headers)
    kind = r.headers.get("content-type", "").split(";")[0]
    if kind == "text/event-stream":
        events = [
            json.loads(line[6:])
            for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        answer = Answer(r.status_code, _stream_shape(events), None)
        answer.value = _probe(case, events)
        return answer
    if kind == "application/json":
        doc = r.json()
        error = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            error = (doc["error"].get("type"), doc["error"].get("param"))
        answer = Answer(r.status_code, _shape(doc), error)
        answer.value = _probe(case, doc)
        if "endpoint-load-metrics" in r.headers:
            answer.value = _orca(r.headers["endpoint-load-metrics"])
        return answer
    if case.path.endswith("/metrics"):
        present = [n for n in METRIC_NAMES if f":{n}" in r.text or f"_{n}" in r.text]
        return Answer(r.status_code, {}, None, present)
    return Answer(r.status_code, {}, None, note=r.text[:60])


def _probe(case: Case, doc: Any) -> Any:
    if case.probe is None:
        return None
    try:
        return case.probe(doc)
    except (KeyError, IndexError, TypeError, StopIteration) as e:
        return f"<not there: {type(e).__name__} {e}>"


def _orca(value: str) -> Any:
    kind, _, rest = value.partition(" ")
    if kind == "JSON":
        return kind, sorted(json.loads(rest)["named_metrics"])
    return kind, sorted(part.split("=")[0] for part in rest.split(", "))


def _shape(doc: Any) -> dict[str, list[str]]:
    if not isinstance(doc, dict):
        return {"top": [type(doc).__name__]}
    shape = {"top": sent_keys(doc)}
    if isinstance(doc.get("error"), dict):
        shape["error"] = sent_keys(doc["error"])
    choices = doc.get("choices")
    if isinstance(choices, list) and choices:
        choice = choices[0]
        shape["choice"] = sent_keys(choice)
        for part in ("message", "delta", "logprobs"):
            if isinstance(choice.get(part), dict):
                shape[part] = sent_keys(choice[part])
    if isinstance(doc.get("usage"), dict):
        shape["usage"] = sent_keys(doc["usage"])
    return shape


def _stream_shape(events: list[dict]) -> dict[str, list[str]]:
    """The first chunk, the union over the content chunks, and the last chunk."""
    if not events:
        return {"events": []}
    merged: dict[str, set[str]] = {}
    for event in events[1:-1]:
        for part, keys in _shape(event).items():
            merged.setdefault(part, set()).update(keys)
    shape = {f"first.{k}": v for k, v in _shape(events[0]).items()}
    shape |= {f"mid.{k}": sorted(v) for k, v in merged.items()}
    shape |= {f"last.{k}": v for k, v in _shape(events[-1]).items()}
    return shape


def differences(a: Answer, b: Answer) -> list[str]:
    diffs = []
    if a.status != b.status:
        diffs.append(f"status {a.status} vs {b.status}")
    if a.error and b.error and a.error[1] != b.error[1]:
        diffs.append(f"param {a.error[1]!r} vs {b.error[1]!r}")
    if a.error and b.error and a.error[0] != b.error[0]:
        diffs.append(f"type {a.error[0]!r} vs {b.error[0]!r}")
    for part in sorted(set(a.shape) | set(b.shape)):
        if part.endswith("error"):
            continue
        only_a = sorted(set(a.shape.get(part, [])) - set(b.shape.get(part, [])))
        only_b = sorted(set(b.shape.get(part, [])) - set(a.shape.get(part, [])))
        if only_a or only_b:
            diffs.append(f"{part}: +A{only_a} +B{only_b}")
    if a.value != b.value:
        diffs.append(f"value {_short(a.value)} vs {_short(b.value)}")
    return diffs


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def served_model(client: httpx.Client, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return client.get("/v1/models", headers=headers).json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    cases = PROFILES[args.profile]
    rows, same = [], 0
    with (
        httpx.Client(base_url=args.base_url_a, timeout=args.timeout) as a,
        httpx.Client(base_url=args.base_url_b, timeout=args.timeout) as b,
    ):
        model_a, model_b = served_model(a, args.api_key), served_model(b, args.api_key)
        for case in cases:
            answer_a = ask(a, case, model_a, args.api_key)
            answer_b = ask(b, case, model_b, args.api_key)
            diffs = differences(answer_a, answer_b)
            same += not diffs
            rows.append((case, answer_a, answer_b, diffs))
    print(f"profile {args.profile}: A={args.base_url_a} B={args.base_url_b}")
    print(f"{'item':>4}  {'A':>3} {'B':>3}  {'case':<58} differences")
    for case, answer_a, answer_b, diffs in rows:
        print(
            f"{case.item:>4}  {answer_a.status:>3} {answer_b.status:>3}  {case.name[:58]:<58} "
            f"{'; '.join(diffs) or 'same'}"
        )
    print(f"{same} of {len(rows)} cases answered the same")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        "item": c.item,
                        "case": c.name,
                        "a": vars(x),
                        "b": vars(y),
                        "differences": d,
                    }
                    for c, x, y, d in rows
                ],
                f,
                indent=1,
                default=str,
            )
    return 0 if same == len(rows) else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "parity",
        help="send the same requests to two servers and diff their answers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _arguments(p)
    p.set_defaults(run=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url-a", required=True, help="e.g. http://127.0.0.1:8000 (zserve)")
    p.add_argument("--base-url-b", required=True, help="e.g. http://127.0.0.1:8001 (vLLM)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="default")
    p.add_argument("--api-key", default=None, help="the key both servers were started with")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="also write every answer to this file")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
