"""`zserve bench engine`: the engine core in-process, beside the limit of a bare HF loop.

Decode: ms per step with B sequences decoding (after a 64-token prompt), for each
engine path (native forward, transformers forward: schedule → forward → sample →
outputs) and for the *limit*: the same HF model's eager forward over its own
DynamicCache, same dtype and threads, no scheduling at all. Prefill: tokens/s over
512-token prompts. Prefix cache: requests sharing a long prefix, one after another,
with the cache off and on: hit rate and speed-up. Each figure is measured --repeats
times; the table shows the median and the range, and `best` = fastest limit step /
fastest engine step, the least disturbed figure when other processes share the cores.
Beside them, the machine's own limits, measured at the same threads: the matmul rate in
the model's dtype and the memory read bandwidth; each decode step's share of the one and
its time against the memory floor (every weight and the K/V read once), and prefill's
share of the matmul rate.

The measurement code (benchmarks/engine_measure.py) imports torch; it is loaded only
when this benchmark runs, so the other `zserve bench` commands stay light.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "engine",
        help="engine-core decode/prefill/prefix-cache throughput beside a bare HF loop",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model", required=True, help="local HF model folder (the small llama)")
    parser.add_argument("--batch-sizes", default="1,32,128", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens before decoding")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=448, help="shared prefix tokens")
    parser.add_argument("--prefix-requests", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--device", default="auto", help="auto | cpu | cuda | cuda:N, for the engines and the limit"
    )
    parser.add_argument(
        "--limit-attn",
        default="sdpa",
        help="attn_implementation of the bare HF loop (sdpa is transformers' default)",
    )
    parser.add_argument("--threads", type=int, default=None, help="default: usable cores")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument(
        "--model-impls",
        default="native,native-torch,transformers",
        help="engine paths to measure, comma-separated: native (with the CPU kernels where "
        "they build), native-torch (the native forward on torch's ops only), transformers, auto",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # Checked before the minutes of decode and prefill measuring, not when the prefix
    # workload finally builds its prompts.
    if not 0 <= args.prefix_len < args.prefill_len:
        raise SystemExit(
            f"zserve bench engine: --prefix-len ({args.prefix_len}) must be at least 0 and "
            f"below --prefill-len ({args.prefill_len}): the prefix workload's prompts are "
            "--prefill-len tokens, of which the first --prefix-len are shared"
        )
    from engine_core.omp_env import set_up_engine_threads

    # As in a serving engine process: torch's OpenMP threads spin briefly, not for
    # milliseconds on the core the kernels' pool needs (a batch-128 step 14 ms vs 9.5).
    set_up_engine_threads()
    from benchmarks.engine_measure import format_table, measure

    result = measure(args)
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
