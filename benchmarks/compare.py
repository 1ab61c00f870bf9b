"""`zserve bench compare`: the same load against two servers, in alternation, and the ratios.

Rounds run A, B, A, B, … so that drift on a shared machine (other jobs, thermal state)
lands on both sides; each figure is the median over rounds, printed with every round's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks import report
from benchmarks.client import Endpoint, list_models
from benchmarks.serve import (
    Run,
    Setup,
    headers_of,
    make_endpoint,
    make_setup,
    measure,
    plan_of,
    print_failures,
    probe,
    run_async,
    served_model,
    warm_up,
)
from benchmarks.serve_args import add_serve_arguments
from benchmarks.stats import Metrics

# (label, value from a run's metrics, higher is better)
FIGURES: list[tuple[str, Callable[[Metrics], float], bool]] = [
    ("output tok/s", lambda m: m.output_throughput, True),
    ("requests/s", lambda m: m.request_throughput, True),
    ("TTFT p50 ms", lambda m: m.ttft.median, False),
    ("TTFT p99 ms", lambda m: m.ttft.percentiles.get(99.0, float("nan")), False),
    ("ITL p50 ms", lambda m: m.itl.median, False),
    ("ITL p99 ms", lambda m: m.itl.percentiles.get(99.0, float("nan")), False),
    ("TPOT mean ms", lambda m: m.tpot.mean, False),
    ("TPOT p50 ms", lambda m: m.tpot.median, False),
    ("E2EL p50 ms", lambda m: m.e2el.median, False),
    ("failed", lambda m: float(m.failed), False),
]


@dataclasses.dataclass(frozen=True)
class Side:
    label: str
    endpoint: Endpoint


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare",
        help="the same load against two OpenAI-compatible servers, alternating, with ratios",
        description=__doc__.splitlines()[0],
    )
    g = parser.add_argument_group("servers")
    g.add_argument("--base-url-a", required=True)
    g.add_argument("--base-url-b", required=True)
    g.add_argument("--label-a", default="A")
    g.add_argument("--label-b", default="B")
    g.add_argument("--model-a", help="model name sent to A (default: --model, else A's first)")
    g.add_argument("--model-b", help="model name sent to B (default: --model, else B's first)")
    g.add_argument("--rounds", type=int, default=3, help="A, B measurements per round")
    add_serve_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def make_side(args: argparse.Namespace, label: str, base_url: str, model: str | None) -> Side:
    base_url = base_url.rstrip("/")
    served = None
    if not (model or args.served_model_name or args.model):
        served = run_async(list_models(base_url, headers_of(args)))[0]
    return Side(label, make_endpoint(args, base_url, served, model))


def ratio(b: float, a: float) -> float:
    return b / a if a else float("nan")


def format_comparison(
    sides: tuple[Side, Side], runs: dict[str, list[Run]], level: int | None
) -> str:
    a, b = sides
    lines = [
        f"=== A = {a.label} vs B = {b.label} · concurrency {level or 'inf'} · "
        f"{len(runs[a.label])} rounds (median; each round in brackets) ===",
        f"{'':<14} {a.label:>12} {b.label:>12} {'B/A':>7} {'A/B':>7}  better  rounds A | B",
    ]
    for name, value, higher_better in FIGURES:
        va = [value(r.metrics) for r in runs[a.label]]
        vb = [value(r.metrics) for r in runs[b.label]]
        ma, mb = statistics.median(va), statistics.median(vb)
        if ma == mb:
            better = "="
        else:
            b_wins = (mb > ma) == higher_better
            factor = max(ratio(mb, ma), ratio(ma, mb))
            better = f"{'B' if b_wins else 'A'} {factor:.2f}x"
        rounds = " ".join(f"{v:.1f}" for v in va) + " | " + " ".join(f"{v:.1f}" for v in vb)
        lines.append(
            f"{name:<14} {ma:>12.2f} {mb:>12.2f} {ratio(mb, ma):>7.3f} {ratio(ma, mb):>7.3f}  "
            f"{better:<7} [{rounds}]"
        )
    return "\n".join(lines)


def comparison_json(
    args: argparse.Namespace, sides: tuple[Side, Side], results: dict[Any, dict[str, list[Run]]]
) -> dict[str, Any]:
    a, b = sides
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "tool": "zserve bench compare",
        "a": {"label": a.label, "api_url": a.endpoint.api_url, "model_id": a.endpoint.model},
        "b": {"label": b.label, "api_url": b.endpoint.api_url, "model_id": b.endpoint.model},
        "rounds": args.rounds,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "levels": [
            {
                "max_concurrency": level,
                a.label: [report.metrics_json(r.metrics) for r in runs[a.label]],
                b.label: [report.metrics_json(r.metrics) for r in runs[b.label]],
            }
            for level, runs in results.items()
        ],
    }


def run(args: argparse.Namespace) -> int:
    if args.label_a == args.label_b:
        print("zserve bench compare: --label-a and --label-b must differ", file=sys.stderr)
        return 2
    try:
        sides = (
            make_side(args, args.label_a, args.base_url_a, args.model_a),
            make_side(args, args.label_b, args.base_url_b, args.model_b),
        )
        setup: Setup = make_setup(args, served_model(args, args.base_url_a.rstrip("/")))
    except (ValueError, OSError, RuntimeError, aiohttp.ClientError) as e:
        print(f"zserve bench compare: {e}", file=sys.stderr)
        return 2
    for side in sides:
        error = probe(side.endpoint, setup, args)
        if error:
            print(f"zserve bench compare: {side.label}: {error}", file=sys.stderr)
            return 1
        warm_up(side.endpoint, setup, args)
    levels = args.max_concurrency or [None]
    results: dict[Any, dict[str, list[Run]]] = {lv: {s.label: [] for s in sides} for lv in levels}
    for round_ in range(args.rounds):
        for level in levels:
            for side in sides:
                run_ = measure(side.endpoint, setup, plan_of(args, level))
                results[level][side.label].append(run_)
                m = run_.metrics
                print(
                    f"round {round_ + 1}/{args.rounds} c={level or 'inf'} {side.label}: "
                    f"{m.output_throughput:.1f} out tok/s, TTFT p50 {m.ttft.median:.1f} ms, "
                    f"ITL p50 {m.itl.median:.1f} ms, {m.failed} failed",
                    flush=True,
                )
                print_failures(run_.results, limit=2)
                time.sleep(1.0)  # let the server drain before the other side starts
    for level in levels:
        print(format_comparison(sides, results[level], level))
    if args.save_result:
        name = args.result_filename or (
            f"compare-{args.label_a}-vs-{args.label_b}-{datetime.now():%Y%m%d-%H%M%S}.json"
        )
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(comparison_json(args, sides, results)))
        print(f"result: {path}")
    ok = all(r.metrics.completed for runs in results.values() for rs in runs.values() for r in rs)
    return 0 if ok else 1
