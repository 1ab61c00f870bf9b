"""The measurements behind `zserve bench engine` (imports torch; loaded only when it runs).

Decode: ms per step with B sequences decoding (after a 64-token prompt), for the
engine (schedule → forward → sample → outputs) and for the *limit*: the same HF
model's eager forward over its own DynamicCache, same dtype and threads, no
scheduling at all. ratio = limit ms / engine ms (≥ 1 means the engine is faster).
Prefill: tokens/s over 512-token prompts. Prefix cache: requests sharing a long
prefix, one after another, with the cache off and on: hit rate and speed-up.
Each figure is measured --repeats times; the table shows the median and the range,
and `best` = fastest limit step / fastest engine step, the least disturbed figure
when other processes share the cores. Beside them, the machine's own limits
(engine_limits.py): each decode step's arithmetic as a share of the measured matmul
rate and its time against the memory floor (every weight and the K/V read once at
the measured bandwidth), and prefill's share of the matmul rate.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import engine_limits
from engine_core.config import EngineConfig
from engine_core.cpu_kernels import CpuKernels, build
from engine_core.engine import EngineCore
from protocol.messages import EngineCoreRequest, SamplingParams


def _engine(
    args: argparse.Namespace, prefix_caching: bool = True, model_impl: str = "auto"
) -> EngineCore:
    # "native-torch": the native forward on torch's ops alone, without the CPU kernels.
    kernels = "off" if model_impl == "native-torch" else "auto"
    return EngineCore(
        EngineConfig(
            model=args.model,
            model_impl=model_impl.removesuffix("-torch"),
            cpu_kernels=kernels,
            dtype=args.dtype,
            device=args.device,
            cpu_threads=args.threads,
            max_num_seqs=max(256, *_batch_sizes(args)),
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=prefix_caching,
            seed=args.seed,
        )
    )


def _batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.batch_sizes.split(",")]


def _prompts(n: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    # Ids well inside the vocabulary, past the small model's specials (0-4).
    return torch.randint(16, vocab - 16, (n, length), generator=gen).tolist()


_ids = iter(range(1 << 62))


def _add(engine: EngineCore, prompt: list[int], max_tokens: int) -> str:
    request_id = f"bench-{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    errors = engine.add_request(EngineCoreRequest(request_id, prompt, params, time.time()))
    if errors:
        raise RuntimeError(errors[0].error)
    return request_id


def _threads_for(engine: EngineCore) -> None:
    # Each side measures with torch's thread count its runner keeps (1 where the CPU
    # kernels run the forward on their own pool); the engines share one process.
    torch.set_num_threads(engine.runner.torch_threads)


def engine_decode_ms(engine: EngineCore, prompts: list[list[int]], steps: int) -> list[float]:
    """ms of each step in which every request decodes one token."""
    _threads_for(engine)
    return [t * 1e3 for t in _prefill_and_decode(engine, prompts, steps)[1]]


def _prefill_and_decode(
    engine: EngineCore, prompts: list[list[int]], steps: int
) -> tuple[float, list[float]]:
    """Seconds to prefill `prompts` (until each has its first token), and of each of
    `steps` steps in which every request decodes one token; the requests end aborted."""
    ids = [_add(engine, p, steps + 2) for p in prompts]
    started: set[str] = set()
    t = time.perf_counter()
    while len(started) < len(ids):  # prefill (chunked by the token budget)
        for outs in engine.step().values():
            started.update(o.request_id for o in outs)
    prefill = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_requests(ids)
    return prefill, times


@torch.inference_mode()
def limit_decode_ms(
    model: torch.nn.Module, prompts: list[list[int]], steps: int, threads: int
) -> list[float]:
    """The bare loop: HF forward over its own DynamicCache, greedy argmax, nothing else."""
    from transformers import DynamicCache

    torch.set_num_threads(threads)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor(prompts, device=model.device), cache=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        engine_limits.sync(token.device)  # the engine's step ends with its tokens on the host
        times.append(time.perf_counter() - t)
    return [t * 1e3 for t in times]


def engine_prefill_tok_s(engine: EngineCore, prompts: list[list[int]]) -> float:
    _threads_for(engine)
    engine.reset_prefix_cache()  # measure computation, not cache hits of the last repeat
    t = time.perf_counter()
    for p in prompts:
        _add(engine, p, 1)
    while engine.has_unfinished_requests():
        engine.step()
    return sum(map(len, prompts)) / (time.perf_counter() - t)


@torch.inference_mode()
def limit_prefill_tok_s(model: torch.nn.Module, prompts: list[list[int]], threads: int) -> float:
    torch.set_num_threads(threads)
    t = time.perf_counter()
    for p in prompts:
        out = model(
            input_ids=torch.tensor([p], device=model.device), use_cache=False, logits_to_keep=1
        )
        engine_limits.sync(out.logits.device)
    return sum(map(len, prompts)) / (time.perf_counter() - t)


def prefix_workload_s(engine: EngineCore, prompts: list[list[int]]) -> float:
    """Requests sharing a prefix, one after another (a shared system prompt)."""
    _threads_for(engine)
    t = time.perf_counter()
    for p in prompts:
        _add(engine, p, 1)
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - t


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(args.seed)
    impls = [i.strip() for i in args.model_impls.split(",") if i.strip()]
    engines = {impl: _engine(args, model_impl=impl) for impl in impls}
    engine = engines[impls[0]]
    threads = engine.runner.num_threads
    dtype = getattr(torch, engine.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation=args.limit_attn
    ).eval()
    model.to(engine.runner.device)
    vocab = engine.vocab_size
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": engine.dtype,
        "device": str(engine.runner.device),
        "threads": threads,
        "limit_attn": args.limit_attn,
        "model_impls": impls,
        "limits": engine_limits.limits(model, engine.runner.device, threads),
        "decode": [],
    }
    # Each timed step's mean context: the prompt, the warm-up steps, half the timed ones.
    context = args.context + 2 + args.decode_steps / 2
    for batch in _batch_sizes(args):
        prompts = _prompts(batch, args.context, vocab, gen)
        limit_decode_ms(model, prompts, 2, threads)  # warm every path at this shape
        for e in engines.values():
            engine_decode_ms(e, prompts, 2)
        lim, best_lim = [], []
        eng: dict[str, list[float]] = {impl: [] for impl in impls}
        best_eng: dict[str, list[float]] = {impl: [] for impl in impls}
        for _ in range(args.repeats):  # interleaved: every side sees the same neighbours
            steps = limit_decode_ms(model, prompts, args.decode_steps, threads)
            lim.append(statistics.median(steps))
            best_lim += steps
            for impl, e in engines.items():
                steps = engine_decode_ms(e, prompts, args.decode_steps)
                eng[impl].append(statistics.median(steps))
                best_eng[impl] += steps
        row: dict[str, Any] = {
            "batch": batch,
            "limit_ms": _summary(lim),
            "limit_tok_s": batch * 1e3 / statistics.median(lim),
        }
        for impl in impls:
            row[impl] = {
                "engine_ms": _summary(eng[impl]),
                "engine_tok_s": batch * 1e3 / statistics.median(eng[impl]),
                "ratio": _summary([lo / e for lo, e in zip(lim, eng[impl])]),
                # On a shared machine the fastest step is the least disturbed one.
                "best_ratio": min(best_lim) / min(best_eng[impl]),
                **engine_limits.decode_figures(
                    result["limits"], batch, context, statistics.median(eng[impl])
                ),
            }
        result["decode"].append(row)

    prompts = _prompts(args.prefill_prompts, args.prefill_len, vocab, gen)
    pre_engine = [engine_prefill_tok_s(engine, prompts) for _ in range(args.repeats)]
    pre_limit = [limit_prefill_tok_s(model, prompts, threads) for _ in range(args.repeats)]
    result["prefill"] = {
        "prompt_len": args.prefill_len,
        "engine_tok_s": _summary(pre_engine),
        "limit_tok_s": _summary(pre_limit),
        **engine_limits.prefill_figures(
            result["limits"], args.prefill_len, statistics.median(pre_engine)
        ),
    }
    del model, engines

    prefix = _prompts(1, args.prefix_len, vocab, gen)[0]
    suffix_len = args.prefill_len - args.prefix_len
    shared = [prefix + s for s in _prompts(args.prefix_requests, suffix_len, vocab, gen)]
    cold = _engine(args, prefix_caching=False, model_impl=impls[0])
    off = [prefix_workload_s(cold, shared) for _ in range(args.repeats)]
    del cold
    on, hit_rates = [], []
    for _ in range(args.repeats):
        engine.reset_prefix_cache()
        before = engine.make_stats()
        on.append(prefix_workload_s(engine, shared))
        after = engine.make_stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hit_rates.append((after.prefix_cache_hits - before.prefix_cache_hits) / queries)
    result["prefix_cache"] = {
        "requests": args.prefix_requests,
        "shared_prefix": args.prefix_len,
        "prompt_len": args.prefill_len,
        "hit_rate": statistics.median(hit_rates),
        "cache_off_s": _summary(off),
        "cache_on_s": _summary(on),
        "speedup": statistics.median(off) / statistics.median(on),
        "best_speedup": min(off) / min(on),
    }
    return result


def _range(s: dict[str, float], fmt: str = ".2f") -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}–{s['max']:{fmt}}]"


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"engine bench: {r['model']} ({r['dtype']} on {r['device']}, {r['threads']} threads, "
        f"limit = bare HF loop with {r['limit_attn']} attention); median [min–max] over "
        f"repeats; ratio = limit ms / engine ms (> 1: faster than the bare loop)",
        f"{'batch':>5}  {'path':<12}  {'ms/step':>22}  {'tok/s':>7}  {'ratio':>18}  {'best':>5}",
    ]
    for d in r["decode"]:
        lines.append(
            f"{d['batch']:>5}  {'bare HF loop':<12}  {_range(d['limit_ms']):>22}  "
            f"{d['limit_tok_s']:>7.0f}"
        )
        for impl in r["model_impls"]:
            e = d[impl]
            lines.append(
                f"{'':>5}  {impl:<12}  {_range(e['engine_ms']):>22}  {e['engine_tok_s']:>7.0f}  "
                f"{_range(e['ratio']):>18}  {e['best_ratio']:>5.2f}"
            )
    lim, first = r["limits"], r["model_impls"][0]
    lines.append(
        f"limits here ({r['threads']} threads): {r['dtype']} matmul "
        f"{lim['matmul_flops'] / 1e9:.0f} GFLOP/s, memory reads "
        f"{lim['read_bytes_s'] / 1e9:.1f} GB/s; the model's linear weights "
        f"{lim['weight_bytes'] / 1e6:.1f} MB"
    )
    lines.append(
        f"{'batch':>5}  {first + ' GFLOP/s':>18}  {'of matmul rate':>14}  "
        f"{'memory floor ms':>15}  {'floor / step':>12}"
    )
    for d in r["decode"]:
        e = d[first]
        lines.append(
            f"{d['batch']:>5}  {e['flops'] / 1e9:>18.0f}  {e['of_matmul_rate']:>14.1%}  "
            f"{e['memory_floor_ms']:>15.2f}  {e['of_memory_floor']:>12.1%}"
        )
    p = r["prefill"]
    lines.append(
        f"prefill {p['prompt_len']}-token prompts ({first}): engine "
        f"{_range(p['engine_tok_s'], '.0f')} tok/s, bare HF forward "
        f"{_range(p['limit_tok_s'], '.0f')} tok/s; {p['flops'] / 1e9:.0f} GFLOP/s, "
        f"{p['of_matmul_rate']:.1%} of the matmul rate (at that rate "
        f"{p['matmul_rate_tok_s']:.0f} tok/s)"
    )
    c = r["prefix_cache"]
    lines.append(
        f"prefix cache ({c['requests']} requests, {c['shared_prefix']}/{c['prompt_len']} tokens "
        f"shared): hit rate {c['hit_rate']:.1%}, off {_range(c['cache_off_s'], '.3f')} s, "
        f"on {_range(c['cache_on_s'], '.3f')} s, speed-up {c['speedup']:.2f}x "
        f"(best {c['best_speedup']:.2f}x)"
    )
    return "\n".join(lines)


def compare_builds(
    model: str, checkouts: list[str], batch: int, context: int, steps: int, rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Seconds of a prefill of `batch` fresh prompts and of a decode step (the median of
    `steps`) for each checkout's build of the kernels, every round, on one engine whose
    one-call forward is swapped between builds; the order reversed every other round
    (scripts/kernels_ab.py). Only the forward is swapped: the packed weights, sampler
    and per-op path stay this checkout's, which every build reads alike."""
    args = argparse.Namespace(
        model=model, dtype="bfloat16", device="cpu", threads=None, batch_sizes=str(batch),
        max_num_batched_tokens=2048, kv_cache_memory_bytes=512 << 20, seed=0,
    )  # fmt: skip
    engine = _engine(args, model_impl="native")
    _threads_for(engine)
    decoder = getattr(engine.runner.backend, "decoder", None)
    if decoder is None:
        raise RuntimeError("this engine has no one-call forward (needs the AVX-512 kernels)")
    builds = []
    for i, checkout in enumerate(checkouts):
        path = build(source=Path(checkout) / "engine_core" / "csrc")
        name = f"{i}:{Path(checkout).resolve().name}"
        builds.append((name, CpuKernels(ctypes.CDLL(str(path)), path)))
    gen = torch.Generator().manual_seed(0)
    out = {name: {"prefill": [], "decode": []} for name, _ in builds}
    for r in range(rounds):
        for name, kernels in builds if r % 2 == 0 else builds[::-1]:
            decoder.use_build(kernels)
            # Fresh prompts each time: no prefix-cache hits.
            prompts = _prompts(batch, context, engine.vocab_size, gen)
            prefill, times = _prefill_and_decode(engine, prompts, steps)
            out[name]["prefill"].append(prefill)
            out[name]["decode"].append(statistics.median(times))
    return out
