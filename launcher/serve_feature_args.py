"""`zserve serve`'s argument groups for the features beside the core server: LoRA,
tools / reasoning / structured outputs, the development routes, Ray. serve_args.py
calls each where its group belongs in --help."""

from __future__ import annotations

import argparse
import logging

from launcher.arg_types import (
    lora_module,
    non_negative,
    positive_int,
    profiler_config,
    resource_map,
)
from launcher.structured_outputs_flag import parse_structured_outputs_config

log = logging.getLogger("zserve.supervisor")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """`zserve serve`'s flags for LoRA adapters (issue 19)."""
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
        type=positive_int,
        default=1,
        help="most adapters in one step (and running at once); a request for another waits",
    )
    g.add_argument(
        "--max-lora-rank", type=positive_int, default=16, help="highest adapter rank accepted"
    )
    g.add_argument(
        "--max-cpu-loras",
        type=positive_int,
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


def add_chat_feature_args(p: argparse.ArgumentParser) -> None:
    """`zserve serve`'s flags for tool calling, reasoning and structured outputs."""
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
        "compile_timeout_s (a request whose constraint compiles longer gets a 400, the "
        "compile is killed, and the same constraint is refused at once for 10 min), "
        "cache_size, max_spec_bytes (largest constraint), max_choices",
    )


def add_dev_args(p: argparse.ArgumentParser) -> None:
    """`zserve serve`'s flags for the development and profiler routes."""
    g = p.add_argument_group(
        "development", "routes for operators and tests, off by default: never expose them"
    )
    g.add_argument(
        "--enable-dev-routes",
        action="store_true",
        help="serve /server_info, /reset_prefix_cache, /sleep, /wake_up, /is_sleeping, "
        "/pause, /resume, /is_paused and /collective_rpc (also: ZSERVE_SERVER_DEV_MODE=1, "
        "as vLLM's VLLM_SERVER_DEV_MODE)",
    )
    g.add_argument(
        "--wait-while-asleep",
        type=non_negative,
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


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tracing", "OpenTelemetry spans, as vLLM exports them")
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="OTLP collector for one 'llm_request' span per request, a child of the "
        "request's traceparent (gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is "
        "http/protobuf); needs pip install 'zserve[tracing]'",
    )
    g.add_argument(
        "--collect-detailed-traces",
        default=None,
        metavar="MODULES",
        help="vLLM's per-step model timings in spans: not supported (refused)",
    )


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """`zserve serve`'s flags for engines on a Ray cluster."""
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
        type=resource_map,
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
        type=non_negative,
        default=60.0,
        help="seconds Ray may take to reserve every engine's bundle before start-up fails",
    )


def profiler_routes_enabled(args: argparse.Namespace) -> bool:
    if args.profiler_config is None:
        return False
    log.warning(
        "the profiler routes are on (--profiler-config): /start_profile and /stop_profile "
        "write traces into %s; for development only",
        args.profiler_config.torch_profiler_dir,
    )
    return True
