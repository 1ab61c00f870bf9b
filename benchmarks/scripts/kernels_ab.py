"""Builds of the CPU kernels compared on one engine, round by round.

One engine (the native forward) is built once; each round runs a prefill of fresh
prompts and then decode steps with the one-call forward (csrc/decoder.c) of each build
in turn, the order reversed every other round. The box's noise falls on every build
alike, so a few percent show (a build against a copy of itself reads x1.00-1.01).
Prints each build's median decode step and prefill, and its ratio to the first build's:
the median and quartiles of the per-round ratios (BENCHMARKS.md §2).

    .venv/bin/python benchmarks/scripts/kernels_ab.py MODEL CHECKOUT [CHECKOUT ...] \\
        [--batch 128] [--context 64] [--rounds 11]

Each CHECKOUT's engine_core/csrc is compiled as the engine compiles its own; the
measuring is engine_measure.compare_builds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import engine_measure  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="local HF model folder")
    p.add_argument("checkouts", nargs="+", help="checkouts whose kernels to compare")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=64, help="prompt tokens")
    p.add_argument("--steps", type=int, default=16, help="decode steps a round")
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    try:
        times = engine_measure.compare_builds(
            args.model, args.checkouts, args.batch, args.context, args.steps, args.rounds
        )
    except RuntimeError as e:
        print(f"kernels_ab: {e}", file=sys.stderr)
        return 2
    first = next(iter(times.values()))
    print(f"batch {args.batch}, {args.context}-token prompts, {args.rounds} rounds")
    for name, t in times.items():
        print(
            f"{name:>16}: decode step {statistics.median(t['decode']) * 1e3:.3f} ms "
            f"{_ratio(t['decode'], first['decode'])}, prefill "
            f"{statistics.median(t['prefill']) * 1e3:.1f} ms "
            f"{_ratio(t['prefill'], first['prefill'])}"
        )
    return 0


def _ratio(these: list[float], base: list[float]) -> str:
    r = sorted(a / b for a, b in zip(these, base))
    return f"x{statistics.median(r):.3f} [{r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
