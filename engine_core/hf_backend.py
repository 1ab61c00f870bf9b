"""The transformers backend: an unmodified transformers causal LM whose attention is
ours (attention.py, registered through transformers' AttentionInterface)."""

from __future__ import annotations

import torch

from engine_core.attention import AttentionMetadata, StepBatch, torch_metadata
from engine_core.config import EngineConfig
from engine_core.kv_cache import PagedKVCache
from engine_core.model_loader import SUPPORTED_ARCHITECTURES, ModelInfo, load_model


class TransformersBackend:
    kernels = None
    architectures = SUPPORTED_ARCHITECTURES

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @staticmethod
    def unsupported_reason(info: ModelInfo) -> str | None:
        return None  # every architecture inspect_model admits

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        info: ModelInfo,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> TransformersBackend:
        return cls(load_model(info, dtype, device))

    def attention_metadata(self, batch: StepBatch, cache: PagedKVCache) -> AttentionMetadata:
        return torch_metadata(batch, cache)

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
