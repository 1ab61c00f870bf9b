"""The seam between the model runner and a model: what every backend provides.

A backend owns a model's forward and the form of attention metadata its attention
reads, so the runner builds a step's shared tensors and asks the backend for the rest,
never which attention it runs. backends.py names the implementations (--model-impl).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine_core.attention import AttentionMetadata, StepBatch
from engine_core.cpu_kernels import CpuKernels
from engine_core.kv_cache import PagedKVCache
from engine_core.lora_adapter import LoraTargets, LoraWeights


class ModelBackend(Protocol):
    # The CPU kernels this backend runs on, if any: the runner gives them the engine's
    # threads, and the sampler draws with them.
    kernels: CpuKernels | None

    def attention_metadata(self, batch: StepBatch, cache: PagedKVCache) -> AttentionMetadata:
        """Everything this backend's attention needs for one step, built once."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """[N] token ids and positions of the packed batch → fp32 logits [len(logits_indices), V]."""
        ...

    def pool_hidden_states(self) -> None:
        """From now on forward() answers the final (normed) hidden states of those rows,
        fp32 [len(logits_indices), hidden], instead of logits (--runner pooling)."""
        ...

    def lora_targets(self) -> LoraTargets:
        """The modules a LoRA adapter may target, by their name in the causal LM, with
        their (in, out) features."""
        ...

    def prepare_lora(self, weights: LoraWeights) -> object:
        """An adapter packed for this backend's forward (runs on the loader thread); the
        runner hands it back in StepBatch.lora, and attention_metadata puts the step's
        form in AttentionMetadata.lora."""
        ...
