"""Builds of the CPU kernels compared on one engine, round by round.

One engine (the native forward) is built once; each round runs a prefill of fresh
prompts and then decode steps with the one-call forward (csrc/decoder.c) of each build
in turn, the order reversed every other round. The box's noise falls on every build
alike, so a few percent show (a build against a copy of itself reads x1.00-1.01).
Prints each build's median decode step and prefill, and its ratio to the first build's:
the median and quartiles of the per-round ratios (BENCHMARKS.md §2).

    .venv/bin/python benchmarks/scripts/kernels_ab.py MODEL CHECKOUT [CHECKOUT ...] \\
        [--batch 128] [--context 64] [--rounds 11]

Each CHECKOUT's engine_core/csrc is compiled as the engine compiles its own
(cpu_kernels.build). Only the forward is swapped: the engine's packed weights, sampler
and per-op path stay this checkout's, which every build reads alike.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import engine_measure  # noqa: E402
from engine_core.cpu_kernels import CpuKernels, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="local HF model folder")
    p.add_argument("checkouts", nargs="+", help="checkouts whose kernels to compare")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=64, help="prompt tokens")
    p.add_argument("--steps", type=int, default=16, help="decode steps a round")
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    engine = engine_measure._engine(
        argparse.Namespace(
            model=args.model, dtype="bfloat16", device="cpu", threads=None,
            batch_sizes=str(args.batch), max_num_batched_tokens=2048,
            kv_cache_memory_bytes=512 << 20, seed=0,
        ),
        model_impl="native",
    )  # fmt: skip
    decoder = getattr(engine.runner.backend, "decoder", None)
    if decoder is None:
        sys.exit("this engine has no one-call forward (needs the AVX-512 kernels)")
    builds = []
    for i, checkout in enumerate(args.checkouts):
        path = build(source=Path(checkout) / "engine_core" / "csrc")
        name = f"{i}:{Path(checkout).resolve().name}"
        builds.append((name, CpuKernels(ctypes.CDLL(str(path)), path)))
    gen = torch.Generator().manual_seed(0)
    decode: dict[str, list[float]] = {name: [] for name, _ in builds}
    prefill: dict[str, list[float]] = {name: [] for name, _ in builds}
    for r in range(args.rounds):
        for name, kernels in builds if r % 2 == 0 else builds[::-1]:
            decoder.use_build(kernels)
            # Fresh prompts each time: no prefix-cache hits.
            prompts = engine_measure._prompts(args.batch, args.context, engine.vocab_size, gen)
            ids = [engine_measure._add(engine, q, args.steps + 2) for q in prompts]
            started: set[str] = set()
            t = time.perf_counter()
            while len(started) < len(ids):
                for outs in engine.step().values():
                    started.update(o.request_id for o in outs)
            prefill[name].append(time.perf_counter() - t)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            engine.abort_requests(ids)
            engine.step()
            decode[name].append(statistics.median(times))
    first = builds[0][0]
    print(f"batch {args.batch}, {args.context}-token prompts, {args.rounds} rounds")
    for name, _ in builds:
        print(
            f"{name:>16}: decode step {statistics.median(decode[name]) * 1e3:.3f} ms "
            f"{_ratio(decode[name], decode[first])}, prefill "
            f"{statistics.median(prefill[name]) * 1e3:.1f} ms "
            f"{_ratio(prefill[name], prefill[first])}"
        )


def _ratio(these: list[float], base: list[float]) -> str:
    r = sorted(a / b for a, b in zip(these, base))
    return f"x{statistics.median(r):.3f} [{r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f}]"


if __name__ == "__main__":
    main()
