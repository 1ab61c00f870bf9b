"""The transformers backend: an unmodified transformers causal LM whose attention is
ours (attention.py, registered through transformers' AttentionInterface)."""

from __future__ import annotations

import torch

from engine_core.attention import AttentionMetadata, StepBatch, torch_metadata
from engine_core.config import EngineConfig
from engine_core.hf_lora import HfLora, LoraStep, pack_hf_lora, wrap_lora_targets
from engine_core.kv_cache import PagedKVCache
from engine_core.lora_adapter import LoraTargets, LoraWeights
from engine_core.model_loader import SUPPORTED_ARCHITECTURES, ModelInfo, load_model


class TransformersBackend:
    kernels = None
    architectures = SUPPORTED_ARCHITECTURES

    def __init__(self, model: torch.nn.Module, lora: bool = False) -> None:
        self.model = model
        # With LoRA the decoder layers' linear layers are wrapped (hf_lora.py).
        self._lora_step = LoraStep()
        self._targets = wrap_lora_targets(model, self._lora_step) if lora else {}
        self._pooling = False

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
        return cls(load_model(info, dtype, device), lora=config.lora is not None)

    def attention_metadata(self, batch: StepBatch, cache: PagedKVCache) -> AttentionMetadata:
        meta = torch_metadata(batch, cache)
        meta.lora = batch.lora
        return meta

    def pool_hidden_states(self) -> None:
        # The base model's output: past its final norm, before the LM head (and before
        # any logit softcapping, as Gemma 2's).
        self._pooling = True

    def lora_targets(self) -> LoraTargets:
        return self._targets

    def prepare_lora(self, weights: LoraWeights) -> HfLora:
        param = next(self.model.parameters())
        return pack_hf_lora(weights, param.dtype, param.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        # use_cache=False: the paged cache is ours; HF would build a DynamicCache.
        # Keyword arguments the model does not know reach the attention function as is.
        self._lora_step.runs = attn_meta.lora
        try:
            if self._pooling:
                base = getattr(self.model, self.model.base_model_prefix)
                out = base(
                    input_ids=input_ids[None],
                    position_ids=positions[None],
                    use_cache=False,
                    attn_meta=attn_meta,
                )
                return out.last_hidden_state[0].index_select(0, logits_indices).float()
            out = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_indices,
                attn_meta=attn_meta,
            )
        finally:
            self._lora_step.runs = None
        return out.logits[0].float()
