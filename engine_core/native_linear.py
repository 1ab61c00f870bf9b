"""The native forward's linear layers on CPU: the kernels' fused bf16 matmul, or
oneDNN's on weights packed once, or F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core import cpu_kernels


class Linear:
    """y = x Wᵀ (+ b), or with `silu_mul` (the fused gate/up weight [2 I, hidden]):
    silu(x Gᵀ) · (x Uᵀ) [M, I]. With `f32` the answer is fp32: y in the weight's
    dtype, then widened (the kernels' matmul does both in one pass).

    bf16 weights on CPU are packed once: for the CPU kernels' matmul where `kernels`
    prefers it (on AMX tiles, or AVX512-BF16 dot products; it also fuses the SiLU
    product), else into oneDNN's blocked layout (faster than F.linear at decode batch sizes,
    bit-identical results; BENCHMARKS.md §2); anything else goes through F.linear, so fp32 stays exactly
    transformers'. A packed weight drops the unpacked one."""

    __slots__ = (
        "weight", "bias", "packed", "kernels", "fused", "bias_f32", "silu_mul", "width", "f32",
        "in_features",
    )  # fmt: skip

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: cpu_kernels.CpuKernels | None = None,
        silu_mul: bool = False,
        f32: bool = False,
    ) -> None:
        self.weight, self.bias, self.packed, self.kernels = weight, bias, None, kernels
        self.silu_mul, self.bias_f32, self.f32 = silu_mul, None, f32
        self.width = weight.shape[0] // 2 if silu_mul else weight.shape[0]
        self.in_features = weight.shape[1]
        bf16_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.fused = bf16_cpu and kernels is not None and kernels.prefer_linear
        if self.fused and kernels.linear_amx and self.in_features % 32:
            # On AMX the kernels' tiles take K in steps of 32; their vector path is
            # ~10x slower than oneDNN's tiles there (BENCHMARKS.md §2).
            self.fused = False
        if self.fused:
            self.packed = kernels.pack_linear(weight, gated=silu_mul)
            self.bias_f32 = None if bias is None else bias.float().contiguous()
        elif bf16_cpu and _PACKING:
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
                probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
                torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                self.packed = packed
            except (RuntimeError, AttributeError):
                pass
        if self.packed is not None:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.kernels.linear(
                x, self.packed, self.bias_f32, self.width, self.silu_mul, self.f32
            )
        y = self.project(x)
        if not self.silu_mul:
            return y.float() if self.f32 else y
        return self.activate(y)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ (+ b) alone: for `silu_mul` the gate and up halves [M, 2 I], before the
        product (LoRA adds to them in between)."""
        if self.fused:
            return self.kernels.linear(x, self.packed, self.bias_f32, self.width, True, raw=True)
        if self.packed is not None:
            rows = x.shape[0]
            pad = row_bucket(rows) - rows
            if pad:  # a row count oneDNN has already built its kernel for
                padded = F.pad(x, (0, 0, 0, pad))
                y = torch.ops.mkldnn._linear_pointwise(
                    padded, self.packed, self.bias, "none", [], ""
                )
                return y[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def warm_up(self, max_rows: int) -> None:
        """Build oneDNN's kernel for every row bucket up to max_rows now, so no step of a
        running server pays for it (a packed weight only; the others build nothing)."""
        if self.packed is None or self.fused:
            return
        for rows in row_buckets(max_rows):
            x = torch.zeros(rows, self.in_features, dtype=self.packed.dtype)
            torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of a `silu_mul` layer's projection [M, 2 I] → [M, I]."""
        if self.kernels is not None:
            return self.kernels.silu_mul(y)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up


_PACKING = torch.backends.mkldnn.is_available()
# oneDNN builds (JIT-compiles) a matmul kernel for each new row count, ~1 ms each at
# decode sizes and 2-3 ms at prefill sizes on this project's AMX Xeon (a new 1,600-row
# prompt took 35 ms more than the next one of its bucket), and a serving engine's steps
# see hundreds of row counts. Above ROW_BUCKET rows a packed matmul runs on the next
# multiple of a step that grows with the count (16 up to 256 rows, then 1/16 of the next
# power of two: at most 1/8 extra rows, which cost little next to a new kernel: M=500 →
# 512: 332 → 298 us for qkv), so 55 kernels cover up to 2,048 rows and the runner
# builds them all at start (Linear.warm_up).
ROW_BUCKET = 16


def row_bucket(rows: int) -> int:
    """The row count a packed matmul of `rows` rows runs on."""
    if rows <= ROW_BUCKET:
        return rows
    step = max(ROW_BUCKET, (1 << (rows - 1).bit_length()) // 16)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every row count row_bucket() answers for 1..max_rows."""
    return sorted({row_bucket(rows) for rows in range(1, max_rows + 1)})


class HiddenStates:
    """The LM head of a pooling model (--runner pooling): the normed hidden states as
    they are, in fp32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def warm_up(self, rows: int) -> None:
        pass
