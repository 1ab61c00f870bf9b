"""`zserve bench …`: each benchmark is a module with `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib

# subcommand -> module under benchmarks/
BENCHMARKS = {
    "serve": "benchmarks.serve",
    "engine": "benchmarks.engine",
    "ipc": "benchmarks.ipc",
    "frontend": "benchmarks.frontend",
    "compare": "benchmarks.compare",
    "parity": "benchmarks.parity",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks and load generators")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for module in BENCHMARKS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # not built yet
        mod.add_parser(sub)
