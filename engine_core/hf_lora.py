"""LoRA in the transformers backend: each targeted linear layer of the model wrapped,
adding the step's adapters to its output run by run (correct first; the native forward
has the batched kernels)."""

from __future__ import annotations

import torch

from engine_core.lora_adapter import LoraTargets, LoraWeights

# One adapter packed for this backend: module name → (Aᵀ [in, r], Bᵀ [r, out]).
HfLora = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoraStep:
    """The step's runs of rows of each adapter, (first row, end row, HfLora), set by the
    backend around each forward; the wrapped layers read it."""

    runs: list[tuple[int, int, HfLora]] | None = None


class LoraLinear(torch.nn.Module):
    """A linear layer whose output gains, on each adapter's rows, x Aᵀ Bᵀ."""

    def __init__(self, base: torch.nn.Linear, name: str, step: LoraStep) -> None:
        super().__init__()
        self.base, self.name, self.step = base, name, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        runs = self.step.runs
        if runs:
            flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            for start, end, adapter in runs:
                ab = adapter.get(self.name)
                if ab is not None:
                    flat_y[start:end] += (flat_x[start:end] @ ab[0]) @ ab[1]
        return y


def wrap_lora_targets(model: torch.nn.Module, step: LoraStep) -> LoraTargets:
    """Wrap every linear layer of the decoder layers; answers their (in, out) features."""
    targets = {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in name
    }
    for name in targets:
        parent, _, attr = name.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, attr, LoraLinear(getattr(holder, attr), name, step))
    return targets


def pack_hf_lora(weights: LoraWeights, dtype: torch.dtype, device: torch.device) -> HfLora:
    return {
        name: (a.t().to(dtype).contiguous().to(device), b.t().to(dtype).contiguous().to(device))
        for name, (a, b) in weights.modules.items()
    }
