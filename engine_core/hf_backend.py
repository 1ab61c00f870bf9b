"""The model behind the runner's seam: an unmodified transformers causal LM.

A backend is anything with `forward(input_ids, positions, attn_meta, logits_indices)
-> logits`; a native implementation can sit beside this one behind `model_impl`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine_core.attention import AttentionMetadata
from engine_core.cpu_kernels import CpuKernels


class ModelBackend(Protocol):
    # The CPU kernels this backend runs on, if any. With them, forward takes
    # AttentionMetadata.rows (the kernels' form), not the torch path's gather indices.
    kernels: CpuKernels | None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """[N] token ids and positions of the packed batch → fp32 logits [len(logits_indices), V]."""
        ...


class TransformersBackend:
    kernels = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        # use_cache=False: the paged cache is ours; HF would build a DynamicCache.
        # Keyword arguments the model does not know reach the attention function as is.
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=logits_indices,
            attn_meta=attn_meta,
        )
        return out.logits[0].float()
