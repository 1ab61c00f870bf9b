"""The native forward in one call of the CPU kernels (csrc/decoder.c).

`native_llama._forward_kernels` calls nine kernels a layer from Python; each call's
Python and ctypes cost a few microseconds, ~0.2 ms of a 1.3 ms one-row decode step of
the small model, and the torch ops around the layers (the embedding, the sampled rows'
last norm, the LM head's wrapper) ~15 us more, several times that with the caches cold
after the weights. Where every projection, the LM head included, runs on the kernels'
matmul, a step without LoRA rows and without prefill chunks for SDPA runs the same
kernels in the same order from C instead: the embedding, the layers, and the sampled
rows' logits, the same results bit for bit, one call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from engine_core.cpu_kernels import CpuKernels
from engine_core.native_linear import Linear

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KEEP_ROWS = 256  # FusedDecoder.logits keeps the buffers of steps of up to this many rows


class LayerWeights(ctypes.Structure):
    """One layer, as decoder.c's struct zs_layer."""

    _fields_ = [
        *((name, _P) for name in ("input_norm", "post_norm", "q_norm", "k_norm")),
        *((name, _P) for name in ("qkv", "o", "gate_up", "down", "qkv_bias")),
        ("k_cache", _P),
        ("v_cache", _P),
        ("window", _I64),
    ]


class ModelShape(ctypes.Structure):
    """decoder.c's struct zs_shape."""

    _fields_ = [
        *((name, _I64) for name in ("layers", "hidden", "inter", "hq", "hkv", "d", "block_size")),
        *((name, _F) for name in ("eps", "scale", "softcap")),
    ]


class StepRows(ctypes.Structure):
    """decoder.c's struct zs_rows: the step's rows as the kernels' attention reads them."""

    _fields_ = [
        *((name, _I64) for name in ("rows", "table_stride", "max_len")),
        *((name, _P) for name in ("positions", "slots", "tables", "row_table", "row_len")),
        ("cos", _P),
        ("sin", _P),
    ]


class StepHead(ctypes.Structure):
    """decoder.c's struct zs_head: the step's token ids and where its logits go."""

    _fields_ = [
        ("ids", _P),
        ("embed", _P),
        ("embed_rows", _I64),
        ("sample", _P),
        ("m", _I64),
        ("vocab", _I64),
        ("norm", _P),
        ("lm_head", _P),
        ("logits", _P),
    ]


class DecoderLayer(Protocol):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    sliding_window: int | None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """The layers' weights as decoder.c reads them, built once per loaded model (a
    reload builds a new backend, and with it a new one of these)."""

    def __init__(
        self,
        kernels: CpuKernels,
        layers: Sequence[DecoderLayer],
        hidden: int,
        inter: int,
        heads: tuple[int, int, int],
        eps: float,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor],
        head: tuple[torch.Tensor, torch.Tensor, Linear],
    ) -> None:
        self._run, self._scratch_len = kernels.decoder, kernels.decoder_scratch
        self.hidden = hidden
        self.cos, self.sin = rope
        self.shape = ModelShape(len(layers), hidden, inter, *heads, 0, eps, scale, 0.0)
        self.layers = (LayerWeights * len(layers))()
        for w, layer in zip(self.layers, layers):
            w.input_norm, w.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            w.q_norm, w.k_norm = _ptr(layer.q_norm), _ptr(layer.k_norm)
            w.qkv, w.o = layer.qkv.packed.data_ptr(), layer.o.packed.data_ptr()
            w.gate_up, w.down = layer.gate_up.packed.data_ptr(), layer.down.packed.data_ptr()
            w.qkv_bias = _ptr(layer.qkv.bias_f32)
            w.window = layer.sliding_window or 0
        embed, norm, lm_head = head
        self.head = StepHead(
            None, embed.data_ptr(), embed.shape[0], None, 0, lm_head.width,
            norm.data_ptr(), lm_head.packed.data_ptr(), None,
        )  # fmt: skip
        self._keep = [*layers, head]  # the tensors behind the pointers
        # h, down and scratch of steps of up to KEEP_ROWS rows, kept from step to step
        # (a larger step's are its own: a long prompt's would hold memory for good).
        self._buffers = torch.empty(0, dtype=torch.bfloat16)

    @classmethod
    def build(
        cls, kernels: CpuKernels | None, layers: Sequence[DecoderLayer], *shape
    ) -> FusedDecoder | None:
        """One for these layers (shape and head: as __init__ takes them after them), or
        None unless every projection, the LM head included, runs on the kernels' matmul,
        with biases on QKV only."""
        lm_head = shape[-1][2]
        if kernels is None or kernels.decoder is None:
            return None
        if not lm_head.fused or lm_head.bias_f32 is not None:
            return None
        for layer in layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(linear.fused for linear in linears):
                return None
            if any(linear.bias_f32 is not None for linear in linears[1:]):
                return None
        return cls(kernels, layers, *shape)

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows,  # attention.PagedRows
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The forward in one call: token ids int64 [N] → fp32 logits
        [len(logits_indices), vocab] of those rows."""
        # Hot path: one call; the buffers are kept from step to step.
        head, n, m = self.head, input_ids.shape[0], logits_indices.shape[0]
        step = self._step(n, positions, rows, kv_caches)
        h_len = n * self.hidden
        scratch_len = self.scratch_len(n, m)
        buffers = self._buffers
        if buffers.numel() < 2 * h_len + scratch_len:
            buffers = torch.empty(2 * h_len + scratch_len, dtype=torch.bfloat16)
            if n <= KEEP_ROWS:
                self._buffers = buffers
        base = buffers.data_ptr()
        logits = torch.empty(m, head.vocab, dtype=torch.float32)
        head.ids, head.sample, head.m = input_ids.data_ptr(), logits_indices.data_ptr(), m
        head.logits = logits.data_ptr()
        bad = self._run(
            self.layers, ctypes.byref(self.shape), ctypes.byref(step), ctypes.byref(head),
            base, base + 2 * h_len, base + 4 * h_len,
        )  # fmt: skip
        if bad > 0:
            raise IndexError(f"token id {int(input_ids[bad - 1])} is not in the embedding")
        if bad < 0:
            raise IndexError(f"logits row {int(logits_indices[-bad - 1])} of a {n}-row step")
        return logits

    def use_build(self, kernels: CpuKernels) -> None:
        """Run the forward of another build of the kernels from now on (benchmarks
        compare builds on one engine); every build reads the same packed weights."""
        self._run, self._scratch_len = kernels.decoder, kernels.decoder_scratch

    def scratch_len(self, n: int, m: int) -> int:
        """bf16 elements of the call's scratch for n rows, m of them sampled (decoder.c
        lays it out and counts it)."""
        return self._scratch_len(ctypes.byref(self.shape), n, m)

    def _step(
        self,
        n: int,
        positions: torch.Tensor,
        rows,  # attention.PagedRows
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> StepRows:
        for w, (k_cache, v_cache) in zip(self.layers, kv_caches):
            w.k_cache, w.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self.shape.block_size = kv_caches[0][0].shape[2]
        return StepRows(
            n, rows.tables.stride(0), rows.max_len, positions.data_ptr(), rows.slots.data_ptr(),
            rows.tables.data_ptr(), rows.row_table.data_ptr(), rows.row_len.data_ptr(),
            self.cos.data_ptr(), self.sin.data_ptr(),
        )  # fmt: skip
