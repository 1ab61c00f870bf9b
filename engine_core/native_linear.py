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

    bf16 weights on CPU are packed once: for the CPU kernels' AVX512-BF16 matmul
    where `kernels` prefers it (it also fuses the SiLU product; not on AMX CPUs),
    else into oneDNN's blocked layout (faster than F.linear at decode batch sizes,
    bit-identical results; BENCHMARKS.md §2); anything else goes through F.linear, so fp32 stays exactly
    transformers'. A packed weight drops the unpacked one."""

    __slots__ = (
        "weight", "bias", "packed", "kernels", "fused", "bias_f32", "silu_mul", "width", "f32",
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
        bf16_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.fused = bf16_cpu and kernels is not None and kernels.prefer_linear
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
            pad = -rows % ROW_BUCKET if rows > ROW_BUCKET else 0
            if pad:  # a row count oneDNN has already built its kernel for
                padded = F.pad(x, (0, 0, 0, pad))
                y = torch.ops.mkldnn._linear_pointwise(
                    padded, self.packed, self.bias, "none", [], ""
                )
                return y[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of a `silu_mul` layer's projection [M, 2 I] → [M, I]."""
        if self.kernels is not None:
            return self.kernels.silu_mul(y)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up


_PACKING = torch.backends.mkldnn.is_available()
# oneDNN builds (JIT-compiles) a matmul kernel for each new row count, ~1.1 ms each on
# this project's AMX Xeon, and a serving engine's steps see hundreds of row counts. Above
# ROW_BUCKET rows a packed matmul runs on the next multiple of it: a handful of extra rows
# cost nothing measurable (M=500 → 512: 332 → 298 us for qkv), so each kernel is built
# once for 16 row counts.
ROW_BUCKET = 16
