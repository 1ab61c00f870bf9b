"""`zserve serve`'s flags: vLLM's names and meanings, each value checked as it is parsed.

launcher/plan.py turns the parsed flags into the typed launch plan; nothing else
reads them.
"""

from __future__ import annotations

import argparse
import json
import re

from frontend.limits import RequestLimits
from protocol.messages import LoraModule

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `1G`, `1000000` → bytes (binary for *iB, decimal otherwise)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1G)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit.endswith("ib"):
        value = number * 1024 ** ("kmgt".index(unit[0]) + 1)
    else:
        value = number * _UNITS[unit.rstrip("b") or ""]
    return int(value)


def _str_list(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e})") from None
        return [str(v) for v in value]
    return [v.strip() for v in text.split(",") if v.strip()]


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _max_logprobs(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the whole vocabulary) or >= 0, got {value}")
    return value


_METRIC_PREFIX = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _metrics_prefix(text: str) -> str:
    if not _METRIC_PREFIX.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot start a Prometheus metric name (letters, digits, _)"
        )
    return text


def cpu_list(text: str) -> list[int]:
    """`0-3,6` → [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 1 or 2-3,6)") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 1 or 2-3,6)")
    return sorted(set(cpus))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def lora_module(text: str) -> LoraModule:
    """One --lora-modules item: NAME=PATH, or JSON {"name", "path", "base_model_name"}
    (vLLM's two forms)."""
    text = text.strip()
    if "=" in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        return LoraModule(name.strip(), path.strip())
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not NAME=PATH or a JSON object: {text!r} (e.g. sql=/adapters/sql or "
            '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\')'
        ) from None
    fields = {"name", "path", "base_model_name"}
    if not isinstance(value, dict) or not {"name", "path"} <= set(value) or set(value) - fields:
        raise argparse.ArgumentTypeError(
            f"a JSON --lora-modules item needs name and path (and may have base_model_name): {text!r}"
        )
    if not all(isinstance(v, str) for v in value.values() if v is not None):
        raise argparse.ArgumentTypeError(f"--lora-modules fields must be strings: {text!r}")
    return LoraModule(value["name"], value["path"], value.get("base_model_name"))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a Hugging Face decoder model (a local folder, or an id already in the "
            "local Hugging Face cache; nothing is downloaded). Without MODEL, a small "
            "random-weight Llama is built once into the user cache and served."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="model folder or cached HF id")
    p.set_defaults(run=_run)

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default=None, help="address to listen on (default: all IPv4)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names the API accepts; the first is the one responses report",
    )
    g.add_argument("--uvicorn-log-level", default="warning")

    g = p.add_argument_group("model")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: MODEL)")
    g.add_argument("--revision", default=None, help="revision of a cached HF model id")
    g.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="context length (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16"],
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="refused: zserve runs only architectures it knows",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 is supported")

    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-num-seqs", type=_positive, default=256)
    g.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap on one request's prefill chunk per step (0: no cap)",
    )
    g.add_argument("--block-size", type=_positive, default=16)
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=None,
        help="KV cache size on CPU, e.g. 2GiB (default 1GiB)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument(
        "--cpu-threads",
        type=_positive,
        default=None,
        help="CPU threads per engine, for its CPU kernels' pool or torch's ops (default: the "
        "usable cores minus one for each local API server after the first, shared by the "
        "local engines; at least 1)",
    )
    g.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default=None,
        help="pin the local engines to these CPUs (e.g. 1 or 2-7), split evenly between "
        "them (default: no pinning)",
    )
    g.add_argument(
        "--api-server-cpus",
        type=cpu_list,
        default=None,
        help="pin the API servers to these CPUs (e.g. 0), so they never take the engines' "
        "cores (default: no pinning)",
    )
    g.add_argument(
        "--model-impl", default="auto", choices=["auto", "native", "vllm", "transformers"]
    )
    g.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=["auto", "off"],
        help="auto: the native bf16 forward on CPU runs zserve's C kernels (fused norms, "
        "RoPE, SiLU, paged attention and, with AVX512-BF16, the matmuls; compiled once per "
        "machine with gcc), falling back to torch's ops where they cannot build; off: "
        "torch's ops always",
    )

    g = p.add_argument_group("LoRA", "adapters in PEFT's format, many served in one batch")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    g.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        action="extend",
        default=[],
        help="adapters loaded at start-up: NAME=PATH, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (PATH: a local folder with '
        "adapter_config.json and adapter_model.safetensors); a request selects one with "
        "model: NAME",
    )
    g.add_argument(
        "--max-loras",
        type=_positive,
        default=1,
        help="most adapters in one step (and running at once); a request for another waits",
    )
    g.add_argument(
        "--max-lora-rank", type=_positive, default=16, help="highest adapter rank accepted"
    )
    g.add_argument(
        "--max-cpu-loras",
        type=_positive,
        default=None,
        help="adapters kept loaded in memory, least recently used dropped first (an adapter "
        "dropped is read again from its folder when a request needs it; default: --max-loras)",
    )
    g.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (what vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 turns on, which zserve also reads): whoever may "
        "call the API may then make the server read any folder it can, so keep --api-key on",
    )

    g = p.add_argument_group("OpenAI API")
    g.add_argument(
        "--max-logprobs",
        type=_max_logprobs,
        default=20,
        help="most logprobs / top_logprobs / prompt_logprobs a request may ask for "
        "(-1: the whole vocabulary)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template (a file, or the template itself) overriding the model's",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests supply their own chat_template",
    )
    g.add_argument(
        "--enable-request-id-headers", action="store_true", help="echo X-Request-Id on responses"
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, as if stream_options.include_usage were set",
    )
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true")
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count in-flight requests for GET /load",
    )
    g.add_argument("--disable-fastapi-docs", action="store_true", help="do not serve /openapi.json")
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log a line per request (off by default, as in vLLM since 0.10)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for older vLLM command lines: request lines are off by default",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine stats line")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but the probes and /metrics "
        "(without this flag: the ZSERVE_API_KEY environment variable, if set)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_str_list,
        default=[],
        help="CORS origins, as JSON ('[\"https://a.example\"]') or a,b (default: none)",
    )
    g.add_argument("--allowed-methods", type=_str_list, default=["*"])
    g.add_argument("--allowed-headers", type=_str_list, default=["*"])
    g.add_argument("--allow-credentials", action="store_true")
    g.add_argument("--root-path", default="", help="path prefix when behind a proxy")
    g.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="module.path.Name of an ASGI middleware class or HTTP middleware "
        "function (repeatable)",
    )
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument(
        "--sse-keep-alive-interval",
        type=_non_negative,
        default=0.0,
        help="seconds between ': keep-alive' comments while a stream waits (0: off)",
    )
    g.add_argument(
        "--stream-interval",
        type=_positive,
        default=1,
        help="tokens per SSE event of a stream (1: every token its own event)",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=_positive,
        default=None,
        help="503 when the server already holds this many requests",
    )
    g.add_argument(
        "--max-num-queued-tokens",
        type=_positive,
        default=None,
        help="503 when this many prompt tokens already wait for prefill",
    )
    g.add_argument(
        "--metrics-prefix",
        type=_metrics_prefix,
        default="zserve",
        help="prefix of /metrics names (vllm: vLLM's names for its dashboards)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="seconds in-flight requests may finish after SIGTERM (0: abort at once)",
    )

    g = p.add_argument_group(
        "limits", "what one client may send; every refusal names the field and the flag"
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=RequestLimits.max_body_bytes,
        help="largest request body (413 above it), e.g. 8MiB",
    )
    g.add_argument(
        "--max-header-bytes",
        type=parse_bytes,
        default=RequestLimits.max_header_bytes,
        help="largest request line plus headers (431 above it)",
    )
    g.add_argument(
        "--max-header-count",
        type=_positive,
        default=RequestLimits.max_header_count,
        help="most headers in one request (431 above it)",
    )
    g.add_argument(
        "--header-read-timeout",
        type=_non_negative,
        default=RequestLimits.header_timeout_s,
        help="seconds a client has to send a request's headers (408 after; 0: no limit)",
    )
    g.add_argument(
        "--body-read-timeout",
        type=_non_negative,
        default=RequestLimits.body_timeout_s,
        help="seconds a client has to send a request's body once its headers are in (408 "
        "after; 0: no limit)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=_positive,
        default=None,
        help="longest prompt text, checked before tokenizing (default: what max_model_len can "
        "hold, max_model_len x the longest token's characters)",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=_positive,
        default=RequestLimits.max_prompts,
        help="most prompts in one completions request",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=_positive,
        default=RequestLimits.max_sequences,
        help="most sequences one request may run (prompts x n); also the largest n",
    )
    g.add_argument(
        "--max-stop-strings",
        type=_positive,
        default=RequestLimits.max_stop_strings,
        help="most stop strings in one request",
    )
    g.add_argument(
        "--max-stop-string-length",
        type=_positive,
        default=RequestLimits.max_stop_chars,
        help="longest stop string, in characters",
    )
    g.add_argument(
        "--max-request-id-length",
        type=_positive,
        default=RequestLimits.max_request_id_chars,
        help="longest request_id or X-Request-Id, in characters",
    )
    g.add_argument(
        "--max-chat-messages",
        type=_positive,
        default=RequestLimits.max_messages,
        help="most messages in one chat request",
    )
    g.add_argument(
        "--tokenizer-pool-size",
        type=int,
        default=1,
        help="worker processes per API server that tokenize long texts, so they never hold "
        "the serving loop (0: a thread of the API server, which does hold it)",
    )
    g.add_argument(
        "--tokenize-timeout",
        type=_non_negative,
        default=60.0,
        help="seconds one long text may take to tokenize before its request fails",
    )

    g = p.add_argument_group("processes")
    g.add_argument(
        "--api-server-count",
        type=_positive,
        default=None,
        help="API-server processes (default: the data-parallel size)",
    )
    g.add_argument("--data-parallel-size", "-dp", type=_positive, default=1)
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None)
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0)
    g.add_argument("--data-parallel-address", "-dpa", default=None)
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None)
    g.add_argument(
        "--headless",
        action="store_true",
        help="start only engine cores, which join a head node over TCP",
    )
    g.add_argument(
        "--engine-ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every engine's READY (and, on a worker, for the head "
        "and its keys)",
    )
    g.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=30.0,
        help="an engine silent this long, or with work but not stepping this long, is "
        "declared dead (the server then exits non-zero)",
    )
    g.add_argument(
        "--engine-keys",
        default=None,
        help="folder with the CURVE keys that secure engine links over TCP; the head creates "
        "them if missing, workers need a copy (default: $XDG_CONFIG_HOME/zserve/engine-keys)",
    )
    g.add_argument("--log-level", default="INFO")


def _run(args: argparse.Namespace) -> int:
    from launcher.serve import serve

    return serve(args)
