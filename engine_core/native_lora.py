"""LoRA in the native forward: adapters packed for its fused projections, and one
step's rows of every adapter applied in one segmented low-rank matmul per projection.

The native forward's four projections per layer are fused (qkv, o, gate_up, down), so
an adapter's q, k and v (gate and up) share one shrink, x Aᵀ with their A's stacked,
and each expands into its own columns of the fused output. With the CPU kernels (bf16
on CPU) one call covers every adapter of the step (csrc/lora.c); elsewhere (fp32, other
devices) torch runs it adapter by adapter, which is exact and correct, not fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core import cpu_kernels
from engine_core.lora_adapter import LoraTargets, LoraWeights

# The projections of one layer, in slot order: slot = layer * 4 + kind.
KINDS = ("qkv", "o", "gate_up", "down")
# Each fused projection's parts, in output-column order, as PEFT names their modules.
PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def native_targets(
    num_layers: int, hidden: int, q_out: int, kv_out: int, intermediate: int
) -> LoraTargets:
    """Every module an adapter may target on the native forward: (in, out) features."""
    shapes = {
        "self_attn.q_proj": (hidden, q_out),
        "self_attn.k_proj": (hidden, kv_out),
        "self_attn.v_proj": (hidden, kv_out),
        "self_attn.o_proj": (q_out, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }
    return {
        f"model.layers.{i}.{part}": shape
        for i in range(num_layers)
        for part, shape in shapes.items()
    }


@dataclass
class _Module:
    """One adapter's part of one fused projection: t = x a_t, then per sub-block
    y[:, col:col + cols] += t[:, first:first + rank] b_t."""

    a_t: torch.Tensor  # [in, R]
    subs: list[tuple[int, int, int, int, torch.Tensor]]  # col, cols, first, rank, b_t [rank, cols]


class NativeLora:
    """An adapter packed for the native forward: per slot its module (or None), and
    with the CPU kernels each module's description (csrc/lora.c) by address."""

    def __init__(
        self,
        weights: LoraWeights,
        num_layers: int,
        widths: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        kernels: cpu_kernels.CpuKernels | None,
    ) -> None:
        """`widths`: each projection's parts' output columns, in PARTS order."""
        self.name = weights.name
        self.modules: list[_Module | None] = []
        self.max_rank = 0  # the widest module's stacked rank: the scratch's columns
        self._keep: list[torch.Tensor] = []  # what the descriptions point into
        descs = []
        for layer in range(num_layers):
            for kind in KINDS:
                parts = [weights.modules.get(f"model.layers.{layer}.{p}") for p in PARTS[kind]]
                module, desc = self._pack(parts, widths[kind], dtype, device, kernels)
                self.modules.append(module)
                descs.append(desc)
        self.has = [m is not None for m in self.modules]
        self.descs = torch.tensor(descs, dtype=torch.int64) if kernels is not None else None

    def _pack(self, parts, widths, dtype, device, kernels) -> tuple[_Module | None, int]:
        present = [(i, ab) for i, ab in enumerate(parts) if ab is not None]
        if not present:
            return None, 0
        cols = [sum(widths[:i]) for i in range(len(parts))]  # each part's first column
        a_rows, subs, kernel_subs, first = [], [], [], 0
        for i, (a, b) in present:
            rank = a.shape[0]
            if kernels is not None and rank % 2:  # the kernels read ranks in pairs
                a = torch.cat([a, a.new_zeros(1, a.shape[1])])
                b = torch.cat([b, b.new_zeros(b.shape[0], 1)], dim=1)
                rank += 1
            a_rows.append(a)
            subs.append((cols[i], b.shape[0], first, rank, b.t().to(dtype).contiguous().to(device)))
            kernel_subs.append((cols[i], b))
            first += rank
        a = torch.cat(a_rows)
        self.max_rank = max(self.max_rank, a.shape[0])
        module = _Module(a.t().to(dtype).contiguous().to(device), subs)
        if kernels is None:
            return module, 0
        desc, keep = cpu_kernels.pack_lora_module(a, kernel_subs)
        self._keep += [desc, *keep]
        return module, desc.data_ptr()


class LoraRows:
    """One step's LoRA rows for the native forward: the runs of rows of each adapter,
    applied projection by projection (`apply`)."""

    def __init__(
        self,
        runs: list[tuple[int, int, NativeLora]],
        num_rows: int,
        kernels: cpu_kernels.CpuKernels | None,
        dtype: torch.dtype,
    ) -> None:
        self.runs = runs
        adapters = {id(a): a for _, _, a in runs}.values()
        self.has = [any(flags) for flags in zip(*(a.has for a in adapters))]
        self.kernels = kernels
        if kernels is None:
            return
        # Segments cover every row; the base model's rows are segments without a module.
        bounds, columns, row = [0], [], 0
        empty = torch.zeros(len(self.has), dtype=torch.int64)
        for start, end, adapter in runs:
            if start > row:
                bounds.append(start)
                columns.append(empty)
            bounds.append(end)
            columns.append(adapter.descs)
            row = end
        self.bounds = torch.tensor(bounds, dtype=torch.int32)
        self.nseg = len(columns)
        self.table = torch.stack(columns, dim=1).contiguous()  # [slots, nseg] addresses
        self.scratch = torch.empty(num_rows, max(a.max_rank for a in adapters), dtype=dtype)

    def apply(self, slot: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [N, out] += every run's (x Aᵀ) Bᵀ of projection `slot`, in place."""
        if self.kernels is not None:
            address = self.table.data_ptr() + slot * self.nseg * 8
            self.kernels.lora(x, y, self.bounds, address, self.nseg, self.scratch)
            return
        for start, end, adapter in self.runs:
            module = adapter.modules[slot]
            if module is None:
                continue
            t = x[start:end] @ module.a_t
            for col, cols, first, rank, b_t in module.subs:
                y[start:end, col : col + cols] += t[:, first : first + rank] @ b_t
