"""`zserve serve`: flags (vLLM's names and meanings) → typed configs.

This is the one place where configuration is parsed; everything below it gets
EngineConfig / FrontendConfig objects.
"""

from __future__ import annotations

import argparse
import os
import re

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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
        help="torch threads per engine (default: usable cores / local engines)",
    )
    g.add_argument(
        "--model-impl", default="auto", choices=["auto", "native", "vllm", "transformers"]
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
        help="seconds to wait for every engine's READY",
    )
    g.add_argument("--log-level", default="INFO")


def _run(args: argparse.Namespace) -> int:
    from launcher.supervisor import serve

    return serve(args)


def refuse_unsupported(args: argparse.Namespace) -> str | None:
    """A clear message for flags zserve deliberately does not support."""
    if args.trust_remote_code:
        return (
            "--trust-remote-code is refused: zserve never runs code shipped with a model; "
            "it serves the architectures it supports natively"
        )
    if args.tensor_parallel_size != 1:
        return (
            f"--tensor-parallel-size {args.tensor_parallel_size} is not supported: zserve "
            f"runs one device per engine; scale out with --data-parallel-size"
        )
    local = args.data_parallel_size_local
    if local is not None and not 0 <= local <= args.data_parallel_size:
        return (
            f"--data-parallel-size-local {local} must be between 0 and "
            f"--data-parallel-size {args.data_parallel_size}"
        )
    if args.headless and (local is None or local < 1):
        return "--headless needs --data-parallel-size-local >= 1 (engines to start here)"
    remote = local is not None and local < args.data_parallel_size
    if (remote or args.headless) and (
        args.data_parallel_address is None or args.data_parallel_rpc_port is None
    ):
        return (
            "engines on other nodes need --data-parallel-address and --data-parallel-rpc-port "
            "(the head's address and handshake port)"
        )
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
