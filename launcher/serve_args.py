"""`zserve serve`'s flags: vLLM's names and meanings, each value checked as it is parsed.

launcher/plan.py turns the parsed flags into the typed launch plan; nothing else
reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

from engine_core.config import ProfilerConfig
from frontend.limits import RequestLimits
from launcher.structured_outputs_flag import parse_structured_outputs_config
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


def _open_paths(text: str) -> list[str]:
    """--api-key-open-paths: checked against the route table at start-up."""
    from frontend.app import api_key_open_paths

    paths = _str_list(text)
    try:
        api_key_open_paths(paths)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return paths


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


# vLLM's profiler fields zserve accepts only at their default value (no effect here).
_PROFILER_DEFAULTS_ONLY = {
    "torch_profiler_dump_cuda_time_total": True,
    "capture_torch_profiler": False,
    "detailed_trace_annotation": False,
    "delay_iterations": 0,
    "max_iterations": 0,
    "warmup_iterations": 0,
    "active_iterations": 5,
    "wait_iterations": 0,
}


def profiler_config(text: str) -> ProfilerConfig:
    """--profiler-config's JSON → ProfilerConfig, every field checked."""
    import json

    try:
        raw = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    raw = dict(raw)
    raw.pop("ignore_frontend", None)  # the API servers never profile: always true here
    for name, default in _PROFILER_DEFAULTS_ONLY.items():
        if name in raw and raw.pop(name) != default:
            raise argparse.ArgumentTypeError(f"{name} is not supported by zserve")
    known = {f.name: f for f in dataclasses.fields(ProfilerConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fields {unknown}; known: {sorted(known)}")
    if raw.get("profiler", "torch") != "torch":
        raise argparse.ArgumentTypeError(
            f"profiler {raw['profiler']!r} is not supported: zserve runs torch's profiler"
        )
    directory = raw.get("torch_profiler_dir")
    if not isinstance(directory, str) or not directory:
        raise argparse.ArgumentTypeError("torch_profiler_dir must be set (a folder)")
    raw["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(directory))
    for name, value in raw.items():
        if name.startswith("torch_profiler_with") or name.endswith(("_shapes", "_gzip")):
            if not isinstance(value, bool):
                raise argparse.ArgumentTypeError(f"{name} must be true or false")
    return ProfilerConfig(**raw)


def _resources(text: str) -> dict[str, float]:
    """'{"zs": 1, "accelerator_type:A100": 0.01}' → Ray custom resources per engine."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({e})") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and isinstance(v, (int, float)) and v >= 0
        for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError(
            f"not a JSON object of resource names to amounts >= 0: {text!r}"
        )
    if {"CPU", "GPU"} & set(value):
        raise argparse.ArgumentTypeError(
            "CPU and GPU are set by --cpu-threads and --device, not --ray-engine-resources"
        )
    return {k: float(v) for k, v in value.items()}


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
    g.add_argument(
        "--grpc",
        action="store_true",
        help="serve gRPC on --port instead of HTTP: the VllmEngine service of smg-grpc-proto "
        "(token ids in and out), for model gateways such as SMG",
    )

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
        help="require 'Authorization: Bearer KEY' on every route but the probes (/health, "
        "/live, /ping, /version) and /metrics (without this flag: the ZSERVE_API_KEY "
        "environment variable, if set). Unlike vLLM, whose key guards /v1 only, this also "
        "guards /tokenize, /detokenize, /invocations, /load, /tokenizer_info and "
        "/server_info; see --api-key-open-paths",
    )
    g.add_argument(
        "--api-key-open-paths",
        type=_open_paths,
        default=[],
        help="routes answered without the API key besides the probes, as JSON or a,b "
        "(e.g. /tokenize,/load); 'vllm' opens every route vLLM leaves open (/tokenize, "
        "/detokenize, /invocations, /load, /tokenizer_info), for vLLM's exact behaviour",
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
    g.add_argument(
        "--root-path",
        default="",
        help="path prefix when behind a proxy: every route is served with and without it",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="name logprob tokens 'token_id:N' unless a request's return_tokens_as_token_ids "
        "says otherwise",
    )
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

    g = p.add_argument_group("tool calling, reasoning and structured outputs")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice "auto" (the default when tools are given) parse tool calls out '
        "of the output; needs --tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="the model's tool-call format: hermes, llama3_json, mistral, qwen3_xml "
        "(qwen3_coder), pythonic, or one a --tool-parser-plugin registers",
    )
    g.add_argument(
        "--tool-parser-plugin",
        default=None,
        help="a Python file whose @register_tool_parser classes become --tool-call-parser names",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        help="split reasoning (<think>...</think>) into the message's `reasoning`: "
        "deepseek_r1 or qwen3",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='do not render the tools into the prompt when tool_choice is "none"',
    )
    g.add_argument(
        "--structured-outputs-config",
        type=parse_structured_outputs_config,
        default={},
        help="JSON or key=value,...: backend (auto | xgrammar), disable_any_whitespace, "
        "enable_in_reasoning (constrain reasoning too), disable_fallback, "
        "disable_additional_properties, reasoning_parser; and zserve's compile_threads, "
        "compile_timeout_s, cache_size, max_spec_bytes (largest constraint), max_choices",
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
        "--max-concurrent-streams",
        type=_positive,
        default=RequestLimits.max_concurrent_streams,
        help="most gRPC streams (requests) one connection may hold open at once (--grpc)",
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

    g = p.add_argument_group(
        "development", "routes for operators and tests, off by default: never expose them"
    )
    g.add_argument(
        "--enable-dev-routes",
        action="store_true",
        help="serve /server_info, /reset_prefix_cache, /sleep, /wake_up, /is_sleeping and "
        "/collective_rpc (also: ZSERVE_SERVER_DEV_MODE=1, as vLLM's VLLM_SERVER_DEV_MODE)",
    )
    g.add_argument(
        "--wait-while-asleep",
        type=_non_negative,
        default=0.0,
        help="seconds a generation request that arrives while the engines sleep waits for "
        "a wake-up before it is refused with 503 (0: refused at once)",
    )
    g.add_argument(
        "--profiler-config",
        type=profiler_config,
        default=None,
        help='JSON, as vLLM\'s: {"profiler": "torch", "torch_profiler_dir": DIR, '
        '"torch_profiler_with_stack": true, "torch_profiler_record_shapes": false, '
        '"torch_profiler_with_memory": false, "torch_profiler_with_flops": false, '
        '"torch_profiler_use_gzip": true}: serves /start_profile and /stop_profile, which '
        "run torch's profiler in every engine and write one trace per engine into DIR",
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
    g.add_argument(
        "--data-parallel-backend",
        "-dpb",
        choices=["mp", "ray"],
        default="mp",
        help="mp: engines are processes of this node (or headless workers on others); ray: "
        "engines are actors of a running Ray cluster (see the Ray group)",
    )
    g.add_argument(
        "--engine-restart-policy",
        choices=["never", "on-failure"],
        default="never",
        help="never: an engine's death fails the server; on-failure: the supervisor starts "
        "that engine again (a Ray actor on another node if its node is gone) and it "
        "re-joins the running API servers (its in-flight requests still fail)",
    )
    g.add_argument("--log-level", default="INFO")

    g = p.add_argument_group(
        "Ray",
        "--data-parallel-backend ray: one placement-group bundle per engine; "
        "--data-parallel-size-local K puts ranks 0..K-1 on the supervisor's own Ray node "
        "and the others on other nodes",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="the running cluster's address HOST:PORT (default: the RAY_ADDRESS environment "
        "variable)",
    )
    g.add_argument(
        "--ray-engine-resources",
        type=_resources,
        default={},
        help="extra Ray resources each engine's bundle asks for, as JSON, e.g. '{\"zs\": 1}' "
        "to place engines only on nodes started with that custom resource",
    )
    g.add_argument(
        "--ray-placement-strategy",
        choices=["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"],
        default="SPREAD",
        help="how Ray spreads the engines' bundles over its nodes",
    )
    g.add_argument(
        "--ray-placement-timeout",
        type=_non_negative,
        default=60.0,
        help="seconds Ray may take to reserve every engine's bundle before start-up fails",
    )


def _run(args: argparse.Namespace) -> int:
    from launcher.serve import serve

    return serve(args)
