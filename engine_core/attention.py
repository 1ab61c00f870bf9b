"""Attention over the paged KV cache, plugged into HF models through `AttentionInterface`
(registered by `register_with_transformers`, when a transformers model is loaded).

transformers projects q/k/v and applies rotary embeddings; this function writes the
new K/V into the cache, then attends over each sequence's cached context.

The batch is packed into one row ([1, N] tokens), single-token (decode) requests
first. Decodes share one attention per layer: their blocks are gathered by block
table (padded with the zeroed null block) and masked. Multi-token chunks attend
per sequence with a bottom-right causal mask, since a chunk's queries sit at the
end of its context.

Cache layout per layer: [num_blocks, Hkv, block_size, D], so gathering a sequence's
blocks head-major yields [Hkv, L, D] without a copy.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_core.kv_cache import PagedKVCache
from engine_core.logits_processors import NEG_INF

ATTN_IMPLEMENTATION = "zserve_paged"
_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of a list of ints, through an `array`: torch.tensor(list) checks each
    element on its own, ~4x slower from a few hundred values (a prompt chunk's rows)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def table_tensor(tables: list[list[int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Block tables [len(tables), the longest], each padded with the null block 0."""
    width = max(len(t) for t in tables)
    flat = [b for t in tables for b in t + [0] * (width - len(t))]
    return int_tensor(flat, dtype).view(len(tables), width)


@dataclass
class PrefillChunk:
    """A multi-token chunk: rows [start, end) of the packed batch."""

    start: int
    end: int
    num_computed: int  # context already in the cache before this chunk
    gather_index: torch.Tensor  # [Hkv * blocks] head-major rows of its context's blocks


@dataclass
class PagedRows:
    """A step's query rows as the CPU kernels take them: every row (decode or prefill)
    attends to its sequence's first row_len positions through that sequence's block
    table, and writes its own K/V to its cache slot first."""

    slots: torch.Tensor  # int64 [N] block * block_size + offset of each new K/V
    tables: torch.Tensor  # int32 [S, width] block tables of the step's sequences
    row_table: torch.Tensor  # int32 [N] which table each row reads
    row_len: torch.Tensor  # int32 [N] position + 1
    max_len: int  # the longest row_len
    # Row ranges [a, b) the kernel attends; the rest are the metadata's `prefills`,
    # chunks long enough that a tiled attention over their gathered context is faster.
    kernel_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepBatch:
    """A step's packed rows, as attention metadata is built from them: the sequences in
    row order, the single-token decodes first, and every row's position."""

    # (block table, tokens already in the cache, new tokens this step) per sequence
    sequences: list[tuple[list[int], int, int]]
    num_decodes: int  # the first num_decodes sequences bring one token each
    positions: torch.Tensor  # int64 [N] on the CPU: each row's position in its sequence
    # (first row, end row, packed adapter) of each run of rows of one LoRA adapter;
    # None: no row of this step has one
    lora: list[tuple[int, int, object]] | None = None


@dataclass
class AttentionMetadata:
    """Everything one forward's attention calls need; built once per step. With
    `rows` (the CPU kernels' form) the torch-path fields stay empty."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [blocks, Hkv, bs, D]
    write_index: torch.Tensor | None = (
        None  # [Hkv * N] cache row (block, head, offset) of each new K/V
    )
    num_decodes: int = 0
    decode_gather_index: torch.Tensor | None = None  # [num_decodes * Hkv * max_blocks]
    decode_positions: torch.Tensor | None = None  # [num_decodes, 1] position of each decode query
    decode_key_positions: torch.Tensor | None = None  # [1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    rows: PagedRows | None = None
    lora: object | None = None  # the step's LoRA rows in the backend's form (or None)
    _decode_biases: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _prefill_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def decode_bias(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, L] fp32: 0 where a key is in the query's context (and
        window), -inf elsewhere; added to the scores, it is the mask."""
        bias = self._decode_biases.get(window)
        if bias is None:
            keys, pos = self.decode_key_positions, self.decode_positions
            excluded = keys > pos
            if window is not None:
                excluded |= keys <= pos - window
            bias = torch.zeros(excluded.shape, device=keys.device).masked_fill_(excluded, NEG_INF)
            bias = self._decode_biases[window] = bias[:, None, None, :]
        return bias

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        """[n, context] bottom-right causal (and window) mask of chunk `index`; True = attend."""
        key = (index, window)
        mask = self._prefill_masks.get(key)
        if mask is None:
            chunk = self.prefills[index]
            device = chunk.gather_index.device
            n = chunk.end - chunk.start
            q_pos = torch.arange(chunk.num_computed, chunk.num_computed + n, device=device)[:, None]
            k_pos = torch.arange(chunk.num_computed + n, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._prefill_masks[key] = mask
        return mask


def torch_metadata(batch: StepBatch, cache: PagedKVCache) -> AttentionMetadata:
    """The metadata `paged_attention` below reads: gather indices and masks, decodes first."""
    bs, dev = cache.block_size, cache.device
    nd = batch.num_decodes
    decodes = batch.sequences[:nd]
    decode_index = decode_pos = key_pos = None
    token_blocks = [blocks[start // bs] for blocks, start, _ in decodes]
    if decodes:
        table = table_tensor([blocks for blocks, _, _ in decodes])
        width = table.shape[1]
        heads = cache.num_kv_heads
        decode_index = (table[:, None, :] * heads + cache.head_offsets[None, :, None]).flatten()
        decode_pos = batch.positions[:nd, None]
        key_pos = cache.key_positions[:, : width * bs]

    chunks = []
    block_parts = [int_tensor(token_blocks)]
    first = nd
    for blocks, start, n in batch.sequences[nd:]:
        block_ids = blocks[: -(-(start + n) // bs)]
        chunk_pos = torch.arange(start, start + n)
        block_parts.append(int_tensor(block_ids)[chunk_pos // bs])
        chunks.append(PrefillChunk(first, first + n, start, gather_index(cache, block_ids)))
        first += n
    token_blocks = torch.cat(block_parts) if chunks else block_parts[0]
    return AttentionMetadata(
        kv_caches=cache.layers,
        write_index=_write_index(cache, token_blocks, batch.positions % bs).to(dev),
        num_decodes=nd,
        decode_gather_index=None if decode_index is None else decode_index.to(dev),
        decode_positions=None if decode_pos is None else decode_pos.to(dev),
        decode_key_positions=key_pos,
        prefills=chunks,
    )


def _write_index(
    cache: PagedKVCache, token_blocks: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Cache rows of N new tokens, ordered [Hkv, N] like the model's K/V."""
    bs = cache.block_size
    base = token_blocks * (cache.num_kv_heads * bs) + offsets
    return (base[None, :] + cache.head_offsets[:, None] * bs).flatten()


def rows_between(chunks: list[PrefillChunk], rows: int) -> list[tuple[int, int]]:
    """The ranges of rows [0, rows) outside `chunks` (which come in row order)."""
    spans, row = [], 0
    for chunk in chunks:
        if chunk.start > row:
            spans.append((row, chunk.start))
        row = chunk.end
    if rows > row:
        spans.append((row, rows))
    return spans


def gather_index(cache: PagedKVCache, block_ids: list[int]) -> torch.Tensor:
    """(block, head) rows of one sequence's blocks, head-major: gathers [Hkv, L, D]."""
    blocks = int_tensor(block_ids)
    index = blocks[None, :] * cache.num_kv_heads + cache.head_offsets[:, None]
    return index.flatten().to(cache.device)


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [B,Hq,D], k/v [B,Hkv,L,D], bias [B,1,1,L] → [B,Hq,D].

    Grouped matmuls instead of SDPA: for one query row per sequence, CPU SDPA is far
    slower than two batched matmuls with the query heads of a KV head stacked
    (BENCHMARKS.md §2, "Figures behind the code").
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B,Hkv,G,L] in the model dtype
    if softcap is None:
        # One op: fp32 scores, scaled and masked (cheaper than cast, scale, fill).
        scores = torch.add(bias, scores, alpha=scaling)
    else:
        scores = scores.float().mul_(scaling)
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [1,Hq,T,D], k/v [1,Hkv,S,D] → [1,Hq,T,D]; mask None means plain causal (S == T)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
        )
    # SDPA has no softcap: tanh-capped scores by hand, softmax in fp32.
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scaling)
    scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is None:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores.masked_fill_(~mask, NEG_INF)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attn_meta: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF attention signature: q [1,Hq,N,D], k/v [1,Hkv,N,D] → ([1,N,Hq,D], None)."""
    if attn_meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs attn_meta from the engine")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks are not supported")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    k_cache, v_cache = attn_meta.kv_caches[module.layer_idx]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    k_rows = k_cache.view(-1, head_dim)  # one row per (block, head, offset)
    v_rows = v_cache.view(-1, head_dim)
    k_rows.index_copy_(0, attn_meta.write_index, key[0].reshape(-1, head_dim))
    v_rows.index_copy_(0, attn_meta.write_index, value[0].reshape(-1, head_dim))
    k_blocks = k_cache.view(-1, block_size, head_dim)  # one row per (block, head)
    v_blocks = v_cache.view(-1, block_size, head_dim)

    num_heads, num_tokens = query.shape[1], query.shape[2]
    nd = attn_meta.num_decodes
    decode_out = None
    if nd:
        q = query[0, :, :nd].transpose(0, 1)  # [nd, Hq, D]
        index = attn_meta.decode_gather_index
        k = k_blocks.index_select(0, index).view(nd, num_kv_heads, -1, head_dim)
        v = v_blocks.index_select(0, index).view(nd, num_kv_heads, -1, head_dim)
        bias = attn_meta.decode_bias(sliding_window)
        decode_out = _decode_attention(q.contiguous(), k, v, bias, scaling, softcap)
        if nd == num_tokens:
            return decode_out.view(1, nd, num_heads, head_dim), None

    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    if decode_out is not None:
        out[0, :nd] = decode_out
    for i, chunk in enumerate(attn_meta.prefills):
        q = query[:, :, chunk.start : chunk.end]
        if chunk.num_computed == 0 and sliding_window is None:
            # A fresh prompt: its own K/V is the whole context.
            k = key[:, :, chunk.start : chunk.end]
            v = value[:, :, chunk.start : chunk.end]
            res = _chunk_attention(q, k, v, None, scaling, softcap)
        else:
            res = cached_chunk_attention(
                q, k_cache, v_cache, attn_meta, i, scaling, sliding_window, softcap
            )
        out[0, chunk.start : chunk.end] = res[0].transpose(0, 1)
    return out, None


def cached_chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_meta: AttentionMetadata,
    index: int,
    scaling: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Chunk `index` of attn_meta.prefills (q [1,Hq,T,D]) over its whole context, its
    own new K/V included, gathered from the cache blocks → [1,Hq,T,D]."""
    chunk = attn_meta.prefills[index]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    context = chunk.num_computed + chunk.end - chunk.start
    rows = chunk.gather_index
    k = k_cache.view(-1, block_size, head_dim).index_select(0, rows)
    v = v_cache.view(-1, block_size, head_dim).index_select(0, rows)
    k = k.view(1, num_kv_heads, -1, head_dim)[:, :, :context]
    v = v.view(1, num_kv_heads, -1, head_dim)[:, :, :context]
    if chunk.num_computed == 0 and window is None:
        mask = None  # plain causal
    else:
        mask = attn_meta.prefill_mask(index, window)
    return _chunk_attention(q, k, v, mask, scaling, softcap)


def register_with_transformers() -> None:
    """Make `paged_attention` a transformers attention implementation. Imported here, not
    at the top: `AttentionInterface` lives in transformers' modeling_utils, whose imports
    (torch._dynamo, triton, ...) cost every engine start 0.4-1.7 s of CPU that the native
    backends never need."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
