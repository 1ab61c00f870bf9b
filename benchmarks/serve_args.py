"""The flags of `zserve bench serve` (shared with `bench compare`), named as vLLM names them."""

from __future__ import annotations

import argparse
import math
import os

from benchmarks.datasets import DATASETS
from benchmarks.structured_load import FIELDS


def int_list(text: str) -> list[int]:
    """`"1,32,128"` → [1, 32, 128]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server is (bench compare has its own pair instead)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--base-url", help="server root, e.g. http://127.0.0.1:8000 (overrides host/port)"
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything but the server's address: API, dataset, load, sampling, output."""
    g = parser.add_argument_group("API")
    g.add_argument(
        "--backend",
        choices=("openai", "openai-chat"),
        help="openai = /v1/completions, openai-chat = /v1/chat/completions (default: from "
        "--endpoint, else openai)",
    )
    g.add_argument("--endpoint", help="API path (default: from --backend)")
    g.add_argument(
        "--model",
        help="model name to send; also the tokenizer folder when it is a local path "
        "(default: the first model of GET /v1/models)",
    )
    g.add_argument("--served-model-name", help="name to send when --model is a path")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model names (LoRA adapters, or the base model's name too) to spread requests "
        "over: each request takes one at random, seeded by --seed",
    )
    g.add_argument("--tokenizer", help="local folder (or file) with the server's tokenizer.json")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra HTTP header, repeatable",
    )
    g.add_argument("--extra-body", help="JSON object merged into every request body")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds without a byte before a request fails (default 600)",
    )

    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="prompt tokens as the server counts them, its BOS included",
    )
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len·(1−r), len·(1+r)]",
    )
    g.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one prefix shared by every random prompt (before the random part)",
    )
    g.add_argument("--sharegpt-output-len", type=int, help="max_tokens for every ShareGPT prompt")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument(
        "--structured-output-ratio",
        type=float,
        default=0.0,
        help="share of the requests constrained to a JSON schema (0..1)",
    )
    g.add_argument("--json-schema-path", help="the schema (default: a small bounded one)")
    g.add_argument(
        "--structured-output-unique-schemas",
        action="store_true",
        help="a distinct schema per constrained request: each one is compiled",
    )
    g.add_argument(
        "--structured-output-field",
        choices=FIELDS,
        default="structured_outputs",
        help="the request field that carries the schema",
    )

    g = parser.add_argument_group("load")
    g.add_argument(
        "--max-concurrency",
        type=int_list,
        default=None,
        metavar="N[,N…]",
        help="requests in flight at most; a comma list (1,32,128) runs a sweep",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, gamma-distributed arrivals (default inf: all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrivals: 1 = Poisson, <1 burstier, >1 more uniform",
    )
    g.add_argument(
        "--num-warmups", type=int, default=0, help="requests sent (and not measured) first"
    )
    g.add_argument("--seed", type=int, default=0)

    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask the server to generate max_tokens whatever it samples (default: on for the "
        "random and prefix-repetition datasets)",
    )
    g.add_argument("--temperature", type=float, help="sent only when given")

    g = parser.add_argument_group("report")
    g.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics printed with percentiles (of ttft,tpot,itl,e2el)",
    )
    g.add_argument("--metric-percentiles", type=float_list, default=[50.0, 90.0, 99.0])
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    g.add_argument("--save-result", action="store_true", help="write a JSON result")
    g.add_argument("--save-detailed", action="store_true", help="include generated texts")
    g.add_argument("--result-dir", default=".")
    g.add_argument("--result-filename", help="JSON file name (a sweep adds -cN)")
    g.add_argument("--label", help="prefix of the default result file name")
    g.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="write a PNG (default path: beside the JSON); on by default with --save-result",
    )
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")
