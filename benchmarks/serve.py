"""`zserve bench serve`: streaming load against any OpenAI-compatible server.

One run = build prompts from the server's tokenizer → probe one request → warm up →
send the load (per concurrency level of a sweep) → metrics, report, JSON, PNG.
`bench compare` reuses the pieces below.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks import report
from benchmarks.client import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Endpoint,
    RequestResult,
    list_models,
)
from benchmarks.datasets import DatasetConfig, SampleRequest, build_requests
from benchmarks.load import LoadPlan, run_load, run_one
from benchmarks.serve_args import add_serve_arguments, add_target_arguments
from benchmarks.stats import (
    METRICS,
    Metrics,
    Timeline,
    compute_metrics,
    count_missing_output_tokens,
    parse_goodput,
    timeline,
)
from benchmarks.structured_load import StructuredLoad, constrain, load_schema, valid_documents
from benchmarks.tokenizer import BenchTokenizer


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="streaming load against an OpenAI-compatible server (vllm bench serve's flags)",
        description=__doc__.splitlines()[0],
    )
    add_target_arguments(parser)
    add_serve_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def run_async(coro: Any) -> Any:
    """asyncio.run on uvloop when present (the client's own CPU cost matters here)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@dataclass
class Run:
    """One measured load: the raw results and what they add up to."""

    max_concurrency: int | None
    results: list[RequestResult]
    metrics: Metrics
    recounted: int  # requests whose output tokens were re-tokenized (no usage sent)


@dataclass(frozen=True)
class Setup:
    """What every load level of an invocation shares."""

    tokenizer: BenchTokenizer
    requests: list[SampleRequest]
    percentiles: list[float]
    slos: dict[str, float]


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _local(path: str | None) -> bool:
    return bool(path) and Path(path).expanduser().exists()


def tokenizer_path(args: argparse.Namespace, served: dict[str, Any] | None) -> str:
    """--tokenizer, else --model when it is a local folder, else the served model's root."""
    if args.tokenizer:
        return args.tokenizer
    for path in (args.model, (served or {}).get("root")):
        if _local(path):
            return path
    raise ValueError("pass --tokenizer with a local folder holding the server's tokenizer.json")


def make_setup(args: argparse.Namespace, served: dict[str, Any] | None = None) -> Setup:
    tok = BenchTokenizer.load(tokenizer_path(args, served))
    cfg = DatasetConfig(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
        prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_output_len=args.prefix_repetition_output_len,
    )
    load = StructuredLoad(
        ratio=args.structured_output_ratio,
        schema=load_schema(args.json_schema_path),
        unique_schemas=args.structured_output_unique_schemas,
        field=args.structured_output_field,
    )
    requests = constrain(build_requests(cfg, tok), load, args.seed)
    requests = with_models(requests, args.lora_modules, args.seed)
    return Setup(tok, requests, args.metric_percentiles, parse_goodput(args.goodput))


def with_models(
    requests: list[SampleRequest], names: list[str] | None, seed: int
) -> list[SampleRequest]:
    """Each request sent to one of `names`, drawn at random (seeded), as vLLM's
    --lora-modules does; none: the endpoint's model for all."""
    if not names:
        return requests
    rng = random.Random(seed)
    return [dataclasses.replace(r, model=rng.choice(names)) for r in requests]


def headers_of(args: argparse.Namespace) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad --header {item!r}: expected KEY=VALUE")
        headers[key.strip()] = value.strip()
    return headers


def served_model(args: argparse.Namespace, base_url: str) -> dict[str, Any] | None:
    """The server's first listed model, when the flags leave the name or tokenizer open."""
    if (args.served_model_name or args.model) and (args.tokenizer or _local(args.model)):
        return None
    return run_async(list_models(base_url, headers_of(args)))[0]


def make_endpoint(
    args: argparse.Namespace,
    base_url: str,
    served: dict[str, Any] | None = None,
    model: str | None = None,
) -> Endpoint:
    """The request target; the model name is `model`, else the flags', else the served one."""
    path = args.endpoint or (CHAT_COMPLETIONS if args.backend == "openai-chat" else COMPLETIONS)
    chat = args.backend == "openai-chat" if args.backend else path.endswith("chat/completions")
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    ignore_eos = args.ignore_eos
    if ignore_eos is None:
        ignore_eos = args.dataset_name in ("random", "prefix-repetition")
    return Endpoint(
        api_url=base_url + path,
        model=model or args.served_model_name or args.model or (served or {})["id"],
        chat=chat,
        headers=headers_of(args),
        ignore_eos=ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
    )


def plan_of(args: argparse.Namespace, max_concurrency: int | None) -> LoadPlan:
    return LoadPlan(
        max_concurrency=max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        progress=not args.disable_tqdm,
    )


def probe(endpoint: Endpoint, setup: Setup, args: argparse.Namespace) -> str | None:
    """Send one request first, as a check; the error of a failed probe, else None."""
    first = setup.requests[0]
    result = run_async(run_one(endpoint, first, args.request_timeout))
    if result.success:
        return None
    return f"the probe request to {endpoint.api_url} failed: {result.error}"


def warm_up(endpoint: Endpoint, setup: Setup, args: argparse.Namespace) -> None:
    if args.num_warmups <= 0:
        return
    warm = [setup.requests[i % len(setup.requests)] for i in range(args.num_warmups)]
    plan = LoadPlan(max_concurrency=None, progress=False, request_timeout_s=args.request_timeout)
    run_async(run_load(endpoint, warm, plan))


def measure(endpoint: Endpoint, setup: Setup, plan: LoadPlan) -> Run:
    """Send the load once and aggregate it."""
    load = run_async(run_load(endpoint, setup.requests, plan))
    recounted = count_missing_output_tokens(load.results, setup.tokenizer)
    metrics = compute_metrics(load.results, load.duration, setup.percentiles, setup.slos)
    return Run(plan.max_concurrency, load.results, metrics, recounted)


def _with_suffix(path: Path, suffix: str, levels: int) -> Path:
    return path.with_name(f"{path.stem}-{suffix}{path.suffix}") if levels > 1 else path


def result_path(args: argparse.Namespace, endpoint: Endpoint, run: Run, levels: int) -> Path:
    conc = f"c{run.max_concurrency}" if run.max_concurrency else "cinf"
    if args.result_filename:
        return _with_suffix(Path(args.result_dir) / args.result_filename, conc, levels)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    model = Path(endpoint.model).name or "model"
    prefix = args.label or ("openai-chat" if endpoint.chat else "openai")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(args.result_dir) / f"{prefix}-{rate}qps-{conc}-{model}-{stamp}.json"


def result_json(
    args: argparse.Namespace, endpoint: Endpoint, setup: Setup, run: Run, tl: Timeline
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "tool": "zserve bench serve",
        "backend": "openai-chat" if endpoint.chat else "openai",
        "api_url": endpoint.api_url,
        "model_id": endpoint.model,
        "tokenizer_id": setup.tokenizer.name,
        "dataset_name": args.dataset_name,
        "num_prompts": len(setup.requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": run.max_concurrency,
        "ignore_eos": endpoint.ignore_eos,
        "temperature": endpoint.temperature,
        "seed": args.seed,
        "goodput_slos_ms": setup.slos or None,
        "output_tokens_recounted": run.recounted,
    }
    out |= report.metrics_json(run.metrics)
    out |= report.timeline_json(tl)
    out |= report.requests_json(run.results, texts=args.save_detailed)
    return out


def plot_path(args: argparse.Namespace, json_path: Path, levels: int, conc: str) -> Path | None:
    if args.no_plot or (args.plot is None and not args.save_result):
        return None
    if args.plot:
        return _with_suffix(Path(args.plot), conc, levels)
    return json_path.with_suffix(".png")


def print_failures(results: list[RequestResult], limit: int = 5) -> None:
    failed = [r.error for r in results if not r.success]
    for i, error in enumerate(failed[:limit]):
        print(f"failed request {i + 1}/{len(failed)}: {error}", file=sys.stderr)


def report_run(
    args: argparse.Namespace, endpoint: Endpoint, setup: Setup, run: Run, levels: int
) -> None:
    """Print one run's report; write its JSON and PNG as asked."""
    print_failures(run.results)
    texts = [r.generated_text if r.success else None for r in run.results]
    valid, constrained = valid_documents(setup.requests, texts)
    if constrained:
        print(f"structured outputs: {valid}/{constrained} constrained responses parse as JSON")
    if run.recounted:
        print(
            f"note: {run.recounted} responses carried no usage; their output tokens were "
            "counted by re-tokenizing the text (may differ slightly from the server's count)",
            file=sys.stderr,
        )
    shown = [m for m in args.percentile_metrics.split(",") if m in METRICS]
    print(
        report.format_report(
            run.metrics,
            title="Serving Benchmark Result",
            max_concurrency=run.max_concurrency,
            request_rate=args.request_rate,
            shown_metrics=shown,
        )
    )
    bucket = max(0.1, min(1.0, run.metrics.duration / 40))
    tl = timeline(run.results, bucket)
    json_path = result_path(args, endpoint, run, levels)
    conc = f"c{run.max_concurrency}" if run.max_concurrency else "cinf"
    if args.save_result:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_bytes(orjson.dumps(result_json(args, endpoint, setup, run, tl)))
        print(f"result: {json_path}")
    png = plot_path(args, json_path, levels, conc)
    if png is not None:
        from benchmarks.plot import save_plot

        png.parent.mkdir(parents=True, exist_ok=True)
        title = f"{endpoint.model} · {endpoint.api_url} · concurrency {run.max_concurrency or '∞'}"
        save_plot(png, run.results, tl, title)
        print(f"plot: {png}")


def format_sweep(runs: list[Run]) -> str:
    rows = [
        f"{'concurrency':>11} {'ok':>6} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>9}"
    ]
    for r in runs:
        m = r.metrics
        rows.append(
            f"{r.max_concurrency or 'inf':>11} {m.completed:>6} {m.failed:>5} "
            f"{m.request_throughput:>8.2f} {m.output_throughput:>10.1f} "
            f"{m.ttft.median:>9.1f} {m.ttft.percentiles.get(99.0, math.nan):>9.1f} "
            f"{m.tpot.median:>9.1f} {m.itl.percentiles.get(99.0, math.nan):>9.1f}"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    base_url = base_url_of(args)
    try:
        served = served_model(args, base_url)
        setup = make_setup(args, served)
        endpoint = make_endpoint(args, base_url, served)
    except (ValueError, OSError, RuntimeError, aiohttp.ClientError) as e:
        print(f"zserve bench serve: {e}", file=sys.stderr)
        return 2
    error = probe(endpoint, setup, args)
    if error:
        print(f"zserve bench serve: {error}", file=sys.stderr)
        return 1
    warm_up(endpoint, setup, args)
    levels = args.max_concurrency or [None]
    runs = []
    for level in levels:
        run_ = measure(endpoint, setup, plan_of(args, level))
        report_run(args, endpoint, setup, run_, len(levels))
        runs.append(run_)
        if len(levels) > 1:
            time.sleep(1.0)  # let the server drain between levels
    if len(runs) > 1:
        print(format_sweep(runs))
    return 0 if all(r.metrics.completed for r in runs) else 1
