"""The native forward of the Llama family (Llama, Qwen2, Qwen3, Mistral), behind the
runner's backend seam: the checkpoint's weights in our own few tensors, fused QKV
and gate/up projections, RoPE tables computed once, the same paged attention as the
transformers backend, logits only for the rows that sample.

The math follows transformers' modeling code operation for operation (RMSNorm in
fp32 then cast, residuals in the model dtype, rotate-half RoPE), so greedy output
equals `generate()`; the rotary tables are transformers' for every rope-scaling variant
it knows (linear, llama3, yarn, longrope), computed without its modeling files (rope.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_core import cpu_kernels
from engine_core.attention import (
    AttentionMetadata,
    PagedRows,
    PrefillChunk,
    StepBatch,
    cached_chunk_attention,
    gather_index,
    int_tensor,
    paged_attention,
    rows_between,
    torch_metadata,
)
from engine_core.config import EngineConfig
from engine_core.cpu_decoder import FusedDecoder
from engine_core.kv_cache import PagedKVCache
from engine_core.lora_adapter import LoraTargets, LoraWeights
from engine_core.model_loader import CheckpointTensors, ModelInfo
from engine_core.native_linear import HiddenStates, Linear
from engine_core.native_lora import LoraRows, NativeLora, native_targets
from engine_core.rope import rope_tables, rope_type

logger = logging.getLogger(__name__)

# Without the kernels' tiled attention (AVX-512 builds), a prefill chunk of at least this many
# rows, attending to at least this many (row, key) pairs, takes SDPA's instead of the
# row walks: from there on it is faster (BENCHMARKS.md §2, "Figures behind the code").
DENSE_MIN_ROWS = 16
DENSE_MIN_WORK = 16384

# The architectures whose decoder layers this forward computes (their rotary modules
# are one and the same: rope.py).
NATIVE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


@dataclass
class _Layer:
    """One decoder layer's weights; `index` is what the attention function keys on."""

    layer_idx: int
    input_norm: torch.Tensor
    qkv: Linear  # [(Hq + 2 Hkv) D, hidden]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 I, hidden], called for silu(gate) · up
    down: Linear
    sliding_window: int | None


class NativeLlamaBackend:
    """forward(input_ids, positions, attn_meta, logits_indices) -> fp32 logits.

    bf16 on CPU runs through the C kernels of cpu_kernels (fused norms, RoPE with
    the cache write, SiLU·mul, paged attention over all rows at once) where they
    build; anything else, fp32 included, is torch's ops, transformers' exact order.
    """

    architectures = tuple(NATIVE_ARCHITECTURES)

    @staticmethod
    def unsupported_reason(info: ModelInfo) -> str | None:
        """Why this model cannot take the native path (None: it can)."""
        if info.architecture not in NATIVE_ARCHITECTURES:
            return f"no native forward for {info.architecture}"
        cfg = info.hf_config
        if "dynamic" in rope_type(cfg):
            return "dynamic NTK rope depends on the sequence length"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"activation {cfg.hidden_act}"
        if getattr(cfg, "mlp_bias", False):
            return "MLP biases"
        return None

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        info: ModelInfo,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> NativeLlamaBackend:
        return cls(info, dtype, device, max_model_len, config.cpu_kernels)

    def __init__(
        self,
        info: ModelInfo,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        use_cpu_kernels: str = "auto",
    ) -> None:
        cfg = info.hf_config
        self.dtype, self.device = dtype, device
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = info.num_kv_heads
        self.head_dim = info.head_dim
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        w = CheckpointTensors(info.path, dtype, device)
        self.cos, self.sin = rope_tables(info.hf_config, max_model_len, dtype, device)
        self.kernels = self._cpu_kernels(use_cpu_kernels)

        def linear(
            weight: torch.Tensor,
            bias: torch.Tensor | None = None,
            silu_mul: bool = False,
            f32: bool = False,
        ) -> Linear:
            return Linear(weight, bias, self.kernels, silu_mul, f32)

        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get("model.norm.weight")
        # fp32 logits for the sampler.
        self.lm_head = linear(
            w.get("lm_head.weight") if w.has("lm_head.weight") else self.embed, f32=True
        )
        layer_types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            biased = w.has(a + "q_proj.bias")
            sliding = (layer_types[i] == "sliding_attention") if layer_types else window is not None
            self.layers.append(
                _Layer(
                    layer_idx=i,
                    input_norm=w.get(p + "input_layernorm.weight"),
                    qkv=linear(
                        torch.cat([w.get(a + f"{x}_proj.weight") for x in "qkv"]),
                        torch.cat([w.get(a + f"{x}_proj.bias") for x in "qkv"]) if biased else None,
                    ),
                    q_norm=w.get(a + "q_norm.weight") if w.has(a + "q_norm.weight") else None,
                    k_norm=w.get(a + "k_norm.weight") if w.has(a + "k_norm.weight") else None,
                    o=linear(w.get(a + "o_proj.weight")),
                    post_norm=w.get(p + "post_attention_layernorm.weight"),
                    gate_up=linear(
                        torch.cat(
                            [w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight")]
                        ),
                        silu_mul=True,
                    ),
                    down=linear(w.get(p + "mlp.down_proj.weight")),
                    sliding_window=window if sliding else None,
                )
            )
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q, kv, kv)
        self.hidden_size, self.intermediate = cfg.hidden_size, cfg.intermediate_size
        self.decoder = FusedDecoder.build(  # the layers in one kernel call, where they can
            self.kernels, self.layers, self.hidden_size, self.intermediate,
            (self.num_heads, self.num_kv_heads, self.head_dim), self.eps, self.scaling,
            (self.cos, self.sin), (self.embed, self.norm, self.lm_head),
        )  # fmt: skip

    def _cpu_kernels(self, use: str) -> cpu_kernels.CpuKernels | None:
        if use == "off" or self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return None
        if self.cos.dtype != torch.bfloat16:  # the kernels read the tables as bf16
            return None
        reason = cpu_kernels.CpuKernels.supports(self.num_heads, self.num_kv_heads, self.head_dim)
        if reason is not None:
            logger.info("CPU kernels do not cover this model (%s): torch's ops", reason)
            return None
        return cpu_kernels.load()

    def attention_metadata(self, batch: StepBatch, cache: PagedKVCache) -> AttentionMetadata:
        """The kernels' form where they run the forward, else torch's; with any LoRA rows."""
        if self.kernels is None:
            meta = torch_metadata(batch, cache)
        else:
            shape = (self.num_heads, self.num_kv_heads, self.head_dim, cache.block_size)
            meta = _paged_rows_metadata(batch, cache, not self.kernels.tiled_attention(*shape))
        if batch.lora is not None:
            meta.lora = LoraRows(batch.lora, len(batch.positions), self.kernels, self.dtype)
        return meta

    def warm_up_matmuls(self, max_rows: int, max_sampled_rows: int) -> None:
        """Build the matmul kernels of every row bucket now (the layers share theirs)."""
        first = self.layers[0]
        for linear in (first.qkv, first.o, first.gate_up, first.down):
            linear.warm_up(max_rows)
        self.lm_head.warm_up(max_sampled_rows)

    def pool_hidden_states(self) -> None:  # the one-call decoder ends in the LM head
        self.lm_head, self.decoder = HiddenStates(), None

    # --- LoRA (native_lora.py) ------------------------------------------------------

    def lora_targets(self) -> LoraTargets:
        return native_targets(
            len(self.layers), self.hidden_size, *self.split[:2], self.intermediate
        )

    def prepare_lora(self, weights: LoraWeights) -> NativeLora:
        q, kv, _ = self.split
        widths = {
            "qkv": (q, kv, kv),
            "o": (self.hidden_size,),
            "gate_up": (self.intermediate, self.intermediate),
            "down": (self.hidden_size,),
        }
        return NativeLora(weights, len(self.layers), widths, self.dtype, self.device, self.kernels)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' order: normalise in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, D]; cos/sin [N, 1, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        if attn_meta.rows is not None:
            return self._forward_kernels(input_ids, positions, attn_meta, logits_indices)
        n = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.sin.index_select(0, positions)[:, None, :]
        lora = attn_meta.lora
        hidden = F.embedding(input_ids, self.embed)
        pruned = False
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = _lora_linear(layer.qkv, x, lora, 4 * i)
            if layer.q_norm is None:
                # q and k rotate together: one set of elementwise ops instead of two.
                qk = self._rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
                v = qkv[:, (hq + hkv) * d :]
            else:
                q, k, v = qkv.split(self.split, dim=-1)
                q = self._rope(self._rms_norm(q.view(n, hq, d), layer.q_norm), cos, sin)
                k = self._rope(self._rms_norm(k.view(n, hkv, d), layer.k_norm), cos, sin)
            # The attention function speaks transformers' layout: [1, H, N, D].
            attn, _ = paged_attention(
                layer,
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.view(n, hkv, d).transpose(0, 1)[None],
                None,
                scaling=self.scaling,
                sliding_window=layer.sliding_window,
                attn_meta=attn_meta,
            )
            attn = attn.reshape(n, hq * d)
            if lora is None and len(logits_indices) < n and i + 1 == len(self.layers):
                # The last layer's o and MLP for the sampled rows only (as the kernels').
                residual, attn = residual[logits_indices], attn[logits_indices]
                pruned = True  # the rows left are the sampled ones, in their order
            hidden = residual + _lora_linear(layer.o, attn, lora, 4 * i + 1)
            residual = hidden
            x = self._rms_norm(hidden, layer.post_norm)
            hidden = residual + self._mlp(layer, x, lora, i)
        if not pruned:
            hidden = hidden.index_select(0, logits_indices)
        return self.lm_head(self._rms_norm(hidden, self.norm))

    def _mlp(self, layer: _Layer, x: torch.Tensor, lora: LoraRows | None, i: int) -> torch.Tensor:
        """down(silu(gate) · up) of x, with the step's LoRA rows where adapters have them
        (gate and up then take the unfused projection: LoRA adds before the product)."""
        if lora is not None and lora.has[4 * i + 2]:
            gate_up = layer.gate_up.project(x)
            lora.apply(4 * i + 2, x, gate_up)
            h = layer.gate_up.activate(gate_up)
        else:
            h = layer.gate_up(x)
        return _lora_linear(layer.down, h, lora, 4 * i + 3)

    def _forward_kernels(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The same arithmetic in fewer passes: each residual add is fused into the
        norm after it, RoPE into the K/V cache write, SiLU·mul into the gate/up matmul
        (or its own kernel)."""
        # Hot path: per layer 4 matmuls and 3-4 kernel calls; all layers in one (cpu_decoder).
        k, rows, eps, lora = self.kernels, attn_meta.rows, self.eps, attn_meta.lora
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.decoder is not None and lora is None and not attn_meta.prefills:
            caches = attn_meta.kv_caches
            return self.decoder.logits(input_ids, positions, rows, caches, logits_indices)
        hidden = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        x = k.rms_norm(hidden, self.layers[0].input_norm, eps)
        # As csrc/decoder.c: the last layer's attention, o and MLP for the sampled rows
        # only (no later layer reads the others), where fewer rows sample than the step has.
        keep = lora is None and logits_indices.shape[0] < input_ids.shape[0]
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = attn_meta.kv_caches[layer.layer_idx]
            qkv = _lora_linear(layer.qkv, x, lora, 4 * i)
            k.rope_store(
                qkv, positions, self.cos, self.sin, hq, hkv, d, k_cache, v_cache,
                rows.slots, layer.q_norm, layer.k_norm, eps,
            )  # fmt: skip
            if keep and i + 1 == len(self.layers):
                sampled = logits_indices  # hidden, then down: those rows alone
                hidden = hidden.index_select(0, sampled)
                attn = k.paged_attention(
                    qkv.index_select(0, sampled)[:, : hq * d], k_cache, v_cache, rows.tables,
                    rows.row_table.index_select(0, sampled), rows.row_len.index_select(0, sampled),
                    hq, self.scaling, layer.sliding_window, None, rows.max_len,
                )  # fmt: skip
            else:
                attn = self._kernel_attention(qkv[:, : hq * d], k_cache, v_cache, attn_meta, layer)
            o = _lora_linear(layer.o, attn, lora, 4 * i + 1)
            x = k.rms_norm(o, layer.post_norm, eps, residual=hidden)
            down = self._mlp(layer, x, lora, i)
            if i + 1 < len(self.layers):
                x = k.rms_norm(down, self.layers[i + 1].input_norm, eps, residual=hidden)
        # Only the rows that sample need the last residual add and the final norm (with
        # `keep`, hidden and down hold those rows alone already).
        if keep:
            last = hidden + down
        else:
            last = hidden.index_select(0, logits_indices) + down.index_select(0, logits_indices)
        return self.lm_head(k.rms_norm(last, self.norm, eps))

    def _kernel_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn_meta: AttentionMetadata,
        layer: _Layer,
    ) -> torch.Tensor:
        """The kernels' attention; without their tiles, long prefill chunks take SDPA's
        over their gathered context (BENCHMARKS.md §2)."""
        rows, hq, window = attn_meta.rows, self.num_heads, layer.sliding_window
        if not attn_meta.prefills:
            return self.kernels.paged_attention(
                q, k_cache, v_cache, rows.tables, rows.row_table, rows.row_len,
                hq, self.scaling, window, None, rows.max_len,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype)
        for a, b in rows.kernel_spans:
            self.kernels.paged_attention(
                q[a:b], k_cache, v_cache, rows.tables, rows.row_table[a:b], rows.row_len[a:b],
                hq, self.scaling, window, None, rows.max_len, out=out[a:b],
            )  # fmt: skip
        d = self.head_dim
        for i, chunk in enumerate(attn_meta.prefills):
            n = chunk.end - chunk.start
            chunk_q = q[chunk.start : chunk.end].view(n, hq, d).transpose(0, 1)[None]
            res = cached_chunk_attention(
                chunk_q, k_cache, v_cache, attn_meta, i, self.scaling, window
            )
            out[chunk.start : chunk.end] = res[0].transpose(0, 1).reshape(n, hq * d)
        return out


def _lora_linear(linear: Linear, x: torch.Tensor, lora: LoraRows | None, slot: int) -> torch.Tensor:
    """linear(x), plus the step's LoRA rows of projection `slot` where any adapter has it."""
    y = linear(x)
    if lora is not None and lora.has[slot]:
        lora.apply(slot, x, y)
    return y


def _paged_rows_metadata(batch: StepBatch, cache: PagedKVCache, sdpa: bool) -> AttentionMetadata:
    """The CPU kernels' metadata: one block table per sequence, one entry per row; with
    `sdpa`, the long prefill chunks that take SDPA's attention."""
    # Hot path: plain lists in one pass, one tensor each at the end (cheaper than torch
    # ops here: a one-row step's metadata is ~10 us).
    bs = cache.block_size
    width = max(-(-(start + n) // bs) for _, start, n in batch.sequences)
    tables: list[int] = []  # [sequences, width], each padded with the null block 0
    row_table: list[int] = []
    row_len: list[int] = []
    slots: list[int] = []
    dense: list[PrefillChunk] = []
    row = 0
    for i, (blocks, start, n) in enumerate(batch.sequences):
        used = -(-(start + n) // bs)
        tables += blocks[:used]
        if used < width:
            tables += [0] * (width - used)
        if n == 1:
            row_table.append(i)
            row_len.append(start + 1)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            row_table += [i] * n
            row_len += range(start + 1, start + n + 1)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
            if sdpa and n >= DENSE_MIN_ROWS and n * (start + n) >= DENSE_MIN_WORK:
                table = blocks[:used]
                dense.append(PrefillChunk(row, row + n, start, gather_index(cache, table)))
        row += n
    rows = PagedRows(
        slots=int_tensor(slots),
        tables=int_tensor(tables, torch.int32).view(len(batch.sequences), width),
        row_table=int_tensor(row_table, torch.int32),
        row_len=int_tensor(row_len, torch.int32),
        max_len=max(row_len),
        kernel_spans=rows_between(dense, row),
    )
    return AttentionMetadata(kv_caches=cache.layers, rows=rows, prefills=dense)
