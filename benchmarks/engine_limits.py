"""What the machine allows, beside `zserve bench engine`'s figures: the device's matmul
rate in the model's dtype and its memory read bandwidth, both measured here at the
engine's thread count, and the model's cost (FLOPs a token, bytes a decode step reads).
Each engine figure then also reads as a fraction of a limit: a decode step against the
time its weights and K/V take to stream from memory, a step's arithmetic against the
matmul rate (imports torch; loaded only when the bench runs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# The matmul that measures the rate: as many rows as a long prefill chunk, the model's
# widest projection (gate and up together), so the rate is one this model can reach.
RATE_ROWS = 2048
# Bytes read to measure the bandwidth: far past any cache.
READ_BYTES = 256 << 20


@dataclass
class ModelCost:
    linear_params: int  # weights of every linear layer, the LM head included
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int  # bytes per weight and per K/V element

    def flops_per_token(self, context: float) -> float:
        """Multiply-adds x 2 of one token: its linear layers, then attention's scores
        and weighted values over `context` positions in every layer."""
        return 2 * self.linear_params + 4 * context * self.heads * self.head_dim * self.layers

    def decode_bytes(self, batch: int, context: float) -> float:
        """What one decode step must read from memory at the least: every weight once,
        and the K/V of `context` positions for each of `batch` sequences."""
        kv = batch * context * self.layers * 2 * self.kv_heads * self.head_dim
        return (self.linear_params + kv) * self.itemsize


def model_cost(model: torch.nn.Module) -> ModelCost:
    """A dense decoder's cost from its HF module tree and config."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(m.in_features * m.out_features for m in linears)
    return ModelCost(
        linear_params=params,
        layers=cfg.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        itemsize=next(model.parameters()).element_size(),
    )


def matmul_rate(
    device: torch.device, dtype: torch.dtype, k: int, n: int, threads: int, tries: int = 5
) -> float:
    """FLOP/s of the fastest of a few [RATE_ROWS, k] x [k, n] matmuls on torch's
    fastest path (oneDNN's packed bf16 weight on CPU where it exists): the rate torch,
    and vLLM's CPU build, reach; a neutral reference for the engine's own kernels."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(RATE_ROWS, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    packed = None
    if device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, RATE_ROWS)
        except (RuntimeError, AttributeError):
            packed = None

    def run() -> torch.Tensor:
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.nn.functional.linear(x, w)

    return 2 * RATE_ROWS * k * n / _best_s(run, device, tries)


def read_bandwidth(device: torch.device, threads: int, tries: int = 5) -> float:
    """Bytes/s of the fastest of a few sums over READ_BYTES (a stream from memory)."""
    torch.set_num_threads(threads)
    x = torch.ones(READ_BYTES // 4, device=device)
    return READ_BYTES / _best_s(lambda: x.sum(), device, tries)


def _best_s(fn: Callable[[], torch.Tensor], device: torch.device, tries: int) -> float:
    fn()  # built and warm
    best = float("inf")
    for _ in range(tries):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's; CPU work is done on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def limits(model: torch.nn.Module, device: torch.device, threads: int) -> dict[str, Any]:
    """The machine's rates and the model's cost, as `zserve bench engine` reports them
    (plain values: they go into its JSON)."""
    cost = model_cost(model)
    cfg = model.config.get_text_config()
    widest = 2 * getattr(cfg, "intermediate_size", cfg.hidden_size)
    dtype = next(model.parameters()).dtype
    return {
        "matmul_flops": matmul_rate(device, dtype, cfg.hidden_size, widest, threads),
        "read_bytes_s": read_bandwidth(device, threads),
        "weight_bytes": cost.linear_params * cost.itemsize,
        "model": asdict(cost),
    }


def decode_figures(
    lim: dict[str, Any], batch: int, context: float, step_ms: float
) -> dict[str, float]:
    """A decode step of `batch` sequences at `context` positions, taking step_ms, against
    the limits: its arithmetic rate and share of the matmul rate, and the memory floor."""
    cost = ModelCost(**lim["model"])
    flops = batch * cost.flops_per_token(context) / (step_ms / 1e3)
    floor_ms = cost.decode_bytes(batch, context) / lim["read_bytes_s"] * 1e3
    return {
        "flops": flops,
        "of_matmul_rate": flops / lim["matmul_flops"],
        "memory_floor_ms": floor_ms,
        "of_memory_floor": floor_ms / step_ms,
    }


def prefill_figures(lim: dict[str, Any], prompt_len: int, tok_s: float) -> dict[str, float]:
    """Prefill at tok_s over prompts of prompt_len: its arithmetic rate, its share of the
    matmul rate, and the tok/s that rate would give (causal: the mean context is half).
    The cost is the model's nominal one, as every row computed its logits and its last
    layer; the engine skips both for a prompt's rows but the last, so this can pass 100 %."""
    per_token = ModelCost(**lim["model"]).flops_per_token(prompt_len / 2)
    return {
        "flops": tok_s * per_token,
        "of_matmul_rate": tok_s * per_token / lim["matmul_flops"],
        "matmul_rate_tok_s": lim["matmul_flops"] / per_token,
    }
