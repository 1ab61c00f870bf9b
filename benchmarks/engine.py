"""`zserve bench engine`: the engine core in-process, beside the limit of a bare HF loop.

Decode: ms per step with B sequences decoding (after a 64-token prompt), for the
engine (schedule → forward → sample → outputs) and for the *limit*: the same HF
model's eager forward over its own DynamicCache, same dtype and threads, no
scheduling at all. ratio = limit ms / engine ms (≥ 1 means the engine is faster).
Prefill: tokens/s over 512-token prompts. Prefix cache: requests sharing a long
prefix, one after another, with the cache off and on: hit rate and speed-up.
Each figure is measured --repeats times; the table shows the median and the range,
and `best` = fastest limit step / fastest engine step, the least disturbed figure
when other processes share the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from protocol.messages import EngineCoreRequest, SamplingParams


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
    parser.set_defaults(run=run)
    return parser


def _engine(args: argparse.Namespace, prefix_caching: bool = True) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
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


def engine_decode_ms(engine: EngineCore, prompts: list[list[int]], steps: int) -> list[float]:
    """ms of each step in which every request decodes one token."""
    ids = [_add(engine, p, steps + 2) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):  # prefill (chunked by the token budget)
        for outs in engine.step().values():
            started.update(o.request_id for o in outs)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_requests(ids)
    return [t * 1e3 for t in times]


@torch.inference_mode()
def limit_decode_ms(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> list[float]:
    """The bare loop: HF forward over its own DynamicCache, greedy argmax, nothing else."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor(prompts), cache=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t)
    return [t * 1e3 for t in times]


def engine_prefill_tok_s(engine: EngineCore, prompts: list[list[int]]) -> float:
    engine.reset_prefix_cache()  # measure computation, not cache hits of the last repeat
    t = time.perf_counter()
    for p in prompts:
        _add(engine, p, 1)
    while engine.has_unfinished_requests():
        engine.step()
    return sum(map(len, prompts)) / (time.perf_counter() - t)


@torch.inference_mode()
def limit_prefill_tok_s(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    t = time.perf_counter()
    for p in prompts:
        model(input_ids=torch.tensor([p]), use_cache=False, logits_to_keep=1)
    return sum(map(len, prompts)) / (time.perf_counter() - t)


def prefix_workload_s(engine: EngineCore, prompts: list[list[int]]) -> float:
    """Requests sharing a prefix, one after another (a shared system prompt)."""
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
    engine = _engine(args)  # sets torch's thread count for both sides
    dtype = getattr(torch, engine.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation=args.limit_attn
    ).eval()
    vocab = engine.vocab_size
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": engine.dtype,
        "threads": torch.get_num_threads(),
        "limit_attn": args.limit_attn,
        "decode": [],
    }
    for batch in _batch_sizes(args):
        prompts = _prompts(batch, args.context, vocab, gen)
        limit_decode_ms(model, prompts, 2)  # warm both paths at this shape
        engine_decode_ms(engine, prompts, 2)
        eng, lim, best_eng, best_lim = [], [], [], []
        for _ in range(args.repeats):  # interleaved: both see the same neighbours
            steps = limit_decode_ms(model, prompts, args.decode_steps)
            lim.append(statistics.median(steps))
            best_lim += steps
            steps = engine_decode_ms(engine, prompts, args.decode_steps)
            eng.append(statistics.median(steps))
            best_eng += steps
        result["decode"].append(
            {
                "batch": batch,
                "engine_ms": _summary(eng),
                "limit_ms": _summary(lim),
                "engine_tok_s": batch * 1e3 / statistics.median(eng),
                "limit_tok_s": batch * 1e3 / statistics.median(lim),
                "ratio": _summary([lo / e for lo, e in zip(lim, eng)]),
                # On a shared machine the fastest step is the least disturbed one.
                "best_ratio": min(best_lim) / min(best_eng),
            }
        )

    prompts = _prompts(args.prefill_prompts, args.prefill_len, vocab, gen)
    pre_engine = [engine_prefill_tok_s(engine, prompts) for _ in range(args.repeats)]
    pre_limit = [limit_prefill_tok_s(model, prompts) for _ in range(args.repeats)]
    result["prefill"] = {
        "prompt_len": args.prefill_len,
        "engine_tok_s": _summary(pre_engine),
        "limit_tok_s": _summary(pre_limit),
    }
    del model

    prefix = _prompts(1, args.prefix_len, vocab, gen)[0]
    suffix_len = args.prefill_len - args.prefix_len
    shared = [prefix + s for s in _prompts(args.prefix_requests, suffix_len, vocab, gen)]
    cold = _engine(args, prefix_caching=False)
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
        f"engine bench: {r['model']} ({r['dtype']}, {r['threads']} threads, "
        f"limit = bare HF loop with {r['limit_attn']} attention); median [min–max] over repeats",
        f"{'batch':>5}  {'engine ms/step':>22}  {'limit ms/step':>22}  "
        f"{'engine tok/s':>12}  {'limit tok/s':>11}  {'limit/engine':>18}  {'best':>5}",
    ]
    for d in r["decode"]:
        lines.append(
            f"{d['batch']:>5}  {_range(d['engine_ms']):>22}  {_range(d['limit_ms']):>22}  "
            f"{d['engine_tok_s']:>12.0f}  {d['limit_tok_s']:>11.0f}  {_range(d['ratio']):>18}  "
            f"{d['best_ratio']:>5.2f}"
        )
    p = r["prefill"]
    lines.append(
        f"prefill {p['prompt_len']}-token prompts: engine {_range(p['engine_tok_s'], '.0f')} tok/s, "
        f"bare HF forward {_range(p['limit_tok_s'], '.0f')} tok/s"
    )
    c = r["prefix_cache"]
    lines.append(
        f"prefix cache ({c['requests']} requests, {c['shared_prefix']}/{c['prompt_len']} tokens "
        f"shared): hit rate {c['hit_rate']:.1%}, off {_range(c['cache_off_s'], '.3f')} s, "
        f"on {_range(c['cache_on_s'], '.3f')} s, speed-up {c['speedup']:.2f}x "
        f"(best {c['best_speedup']:.2f}x)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
