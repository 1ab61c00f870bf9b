"""zserve's CPU kernels (csrc/, one C file per op), compiled once per machine and called
through ctypes.

The native bf16 forward on CPU runs its elementwise steps fused (RMSNorm with the
residual add, RoPE with the KV-cache write, SiLU·mul) and its paged attention over
every query row at once, reading K/V straight from the cache blocks instead of
gathering them. The C is built for the CPU it runs on (AVX-512 with bf16 dot
products where the CPU has them, portable C elsewhere) into the user cache, keyed by
the sources, the compiler and the CPU, so it compiles once (a few seconds). Where no
C compiler works, `load()` answers None with the reason logged, and the forward keeps
torch's ops.

ctypes releases the GIL for each call, so the engine's output thread runs meanwhile.
The kernels run on a thread pool of their own (set_threads), which never waits for a
worker that has not started on a loop and lets idle workers sleep; see csrc/pool.c.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")  # *.c: one op each; kernels.h: what they share
ABI = 10  # zs_abi() of the source this module speaks to
MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads per KV head
TILED_MIN_ROWS = 8  # csrc/kernels.h ZS_TILED_MIN_ROWS: a run of rows of one sequence takes tiles

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "zs_rms_norm": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F],
    "zs_silu_mul": [_P, _I64, _P, _I64, _I64, _I64],
    "zs_rope_store": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _F, _P, _P, _P, _I64],
    "zs_paged_attention": [
        _P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _F, _P, _I64,
        _I64,
    ],
    "zs_softmax_draw": [_P, _I64, _P, _I64, _I64, _P],
    "zs_argmax": [_P, _I64, _I64, _I64, _P],
    "zs_apply_bitmask": [_P, _I64, _P, _I64, _P, _I64, _I64],
    "zs_lora": [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64],
}  # fmt: skip
# The linear layers are in the AVX-512 build only (elsewhere oneDNN's matmul is faster).
_LINEAR_SIGNATURES = {
    "zs_linear_packed_len": [_I64, _I64, _INT],
    "zs_pack_linear": [_P, _I64, _I64, _INT, _P],
    "zs_linear": [_P, _I64, _P, _P, _I64, _I64, _I64, _INT, _P, _I64, _INT],
}


class CpuKernels:
    """Typed wrappers of the compiled kernels; every tensor is bf16 on the CPU."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._rms_norm = lib.zs_rms_norm
        self._silu_mul = lib.zs_silu_mul
        self._rope_store = lib.zs_rope_store
        self._attention = lib.zs_paged_attention
        self._softmax_draw = lib.zs_softmax_draw
        self._argmax = lib.zs_argmax
        self._apply_bitmask = lib.zs_apply_bitmask
        self._lora = lib.zs_lora
        self.avx512 = bool(lib.zs_has_avx512())
        lib.zs_set_threads.argtypes, lib.zs_set_threads.restype = [_INT], _INT
        self._set_threads = lib.zs_set_threads
        self.threads = self.set_threads(torch.get_num_threads())
        # Whether linear()/pack_linear() exist: the AVX-512 build's matmul.
        self.has_linear = self.avx512
        # Whether the forward should take it: where it runs on AMX tiles (on a decode
        # step's rows much faster than oneDNN's, which run on them too: BENCHMARKS.md
        # §1), or where oneDNN has no tiles to run on; not where only oneDNN has them
        # (a build without AMX on an AMX CPU: oneDNN is faster from a handful of rows).
        self.amx = onednn_uses_amx()
        self.linear_amx = self.has_linear and bool(lib.zs_linear_amx())
        self.prefer_linear = self.has_linear and (self.linear_amx or not self.amx)
        lib.zs_tiled_attention_ready.argtypes = [_I64] * 4
        lib.zs_tiled_attention_ready.restype = _INT
        lib.zs_tiled_attention_enable.argtypes = [_INT]
        lib.zs_tiled_attention_enable.restype = _INT
        self._tiled_ready = lib.zs_tiled_attention_ready
        self._tiled_enable = lib.zs_tiled_attention_enable
        self.decoder = self.decoder_scratch = None
        if self.has_linear:
            for name, argtypes in _LINEAR_SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, None
            lib.zs_linear_packed_len.restype = _I64
            self._packed_len = lib.zs_linear_packed_len
            self._pack_linear = lib.zs_pack_linear
            self._linear = lib.zs_linear
            # The forward in one call (cpu_decoder.py), on the kernels' matmul.
            lib.zs_decoder_logits.argtypes, lib.zs_decoder_logits.restype = [_P] * 7, _I64
            self.decoder = lib.zs_decoder_logits
            lib.zs_decoder_scratch.argtypes, lib.zs_decoder_scratch.restype = [_P, _I64, _I64], _I64
            self.decoder_scratch = lib.zs_decoder_scratch

    def tiled_attention(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
    ) -> bool:
        """Whether paged_attention takes tiles (AMX's, or AVX512-BF16 dot products in
        their layout) for runs of rows of one sequence (prompt chunks) of this shape;
        then no chunk needs SDPA (csrc/tiled_attention.c)."""
        return bool(self._tiled_ready(num_heads, num_kv_heads, head_dim, block_size))

    def enable_tiled_attention(self, on: bool) -> bool:
        """Turns the tiled attention on or off (for comparisons); answers whether it was on."""
        return bool(self._tiled_enable(int(on)))

    def set_threads(self, threads: int) -> int:
        """Threads the kernels split their loops over, the caller included (the pool
        is per process); answers the count in effect."""
        self.threads = self._set_threads(threads)
        return self.threads

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
        """Why these attention shapes cannot run here (None: they can)."""
        if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
            return (
                f"{num_heads} query heads over {num_kv_heads} KV heads (at most {MAX_GROUP} each)"
            )
        if head_dim > MAX_HEAD_DIM or head_dim % 2:
            return f"head_dim {head_dim} (even, at most {MAX_HEAD_DIM})"
        return None

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """norm(x), or with `residual`: residual += x (in place), then norm(residual).
        x and residual [rows, hidden], rows may be strided."""
        rows, hidden = x.shape
        out = torch.empty(rows, hidden, dtype=x.dtype)
        self._rms_norm(
            x.data_ptr(), x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            weight.data_ptr(), out.data_ptr(), hidden, rows, hidden, eps,
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [rows, 2 I] → [rows, I]."""
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter)
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> None:
        """qkv [N, (Hq + 2 Hkv) D]: q rotated in place; rotated k and v written to cache
        slot `slots[n]` (block * block_size + offset) of caches [blocks, Hkv, bs, D].
        positions and slots are int64 [N]; q_norm/k_norm are per-head RMSNorm weights."""
        self._rope_store(
            qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            qkv.shape[0], num_heads, num_kv_heads, head_dim,
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[2],
        )  # fmt: skip

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        row_table: torch.Tensor,
        row_len: torch.Tensor,
        num_heads: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        max_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [N, Hq * D] (rows may be strided) → [N, Hq * D]: row n attends to the first
        row_len[n] positions of the sequence whose block table is tables[row_table[n]]
        (int32 [S, width]; row_table and row_len int32 [N]; max_len >= every row_len).
        `out`, if given, takes the result (rows may be strided). Where tiled_attention()
        holds, each run of TILED_MIN_ROWS or more rows of one table (a prompt chunk)
        takes the tiles, its probabilities rounded to bf16 as SDPA rounds them."""
        rows = q.shape[0]
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        if out is None:
            out = torch.empty(rows, num_heads * head_dim, dtype=q.dtype)
        self._attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), row_table.data_ptr(), row_len.data_ptr(),
            rows, num_heads, num_kv_heads, head_dim, block_size, window or 0, scale,
            softcap or 0.0, out.data_ptr(), out.stride(0), max_len,
        )  # fmt: skip
        return out

    def softmax_draw(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] (-inf: excluded), uniforms u fp32 [B] in [0, 1) → token
        ids int64 [B]: per row the inverse-CDF draw from softmax(logits)."""
        rows, vocab = logits.shape
        u = u.reshape(rows).contiguous()
        out = torch.empty(rows, dtype=torch.long)
        self._softmax_draw(
            logits.data_ptr(), logits.stride(0), u.data_ptr(), rows, vocab, out.data_ptr()
        )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] (rows may be strided) → int64 [B]: torch's argmax (the
        first NaN of a row that has one, else the first index of its largest value)."""
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._argmax(logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr())
        return out

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """fp32 logits [B, V] (rows may be strided), int32 bitmask [>= B, ceil(V/32)]: -inf
        in place on each listed row's tokens whose bit is 0 (structured outputs)."""
        if logits.stride(1) != 1 or bitmask.stride(1) != 1:
            raise ValueError("apply_bitmask needs rows of contiguous logits and words")
        index = torch.tensor(rows, dtype=torch.long)
        self._apply_bitmask(
            logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
            index.data_ptr(), len(rows), logits.shape[1],
        )  # fmt: skip

    def pack_linear(self, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """bf16 weight [N, K] → the packed layout linear() reads (about the same size).
        gated: the weight is gate and up stacked, [2 I, K], for linear(gated=True)."""
        rows, k = weight.shape
        n = rows // 2 if gated else rows
        weight = weight.contiguous()
        out = torch.empty(self._packed_len(n, k, gated), dtype=torch.bfloat16)
        self._pack_linear(weight.data_ptr(), n, k, gated, out.data_ptr())
        return out

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        gated: bool = False,
        out_f32: bool = False,
        raw: bool = False,
    ) -> torch.Tensor:
        """x [M, K] (rows may be strided) @ the packed weight's [N, K]ᵀ (+ bias, fp32
        [N]) → bf16 [M, N], or with out_f32 fp32 [M, N]: the same bf16-rounded values,
        as .float() of the bf16 result, in one pass; gated (no bias, bf16 out):
        silu(x Gᵀ) · (x Uᵀ) → [M, I = n], rounded as silu_mul() of the projection, or
        with `raw` the projection itself, [M, 2 I] (gate then up)."""
        rows, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        if out_f32 and gated:
            raise ValueError("the gated matmul answers bf16 only")
        width = 2 * n if gated and raw else n
        out = torch.empty(rows, width, dtype=torch.float32 if out_f32 else x.dtype)
        self._linear(
            x.data_ptr(), x.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, n, k,
            _GATED_RAW if gated and raw else gated, out.data_ptr(), width, out_f32,
        )  # fmt: skip
        return out

    def lora(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        bounds: torch.Tensor,
        descs: int,
        nseg: int,
        scratch: torch.Tensor,
    ) -> None:
        """y [M, N] += each segment's (x Aᵀ) Bᵀ in place, x [M, K] (rows may be strided):
        segment s is rows bounds[s]..bounds[s + 1] (int32 [nseg + 1]) with the module
        description at the address the int64 at `descs` + 8 s holds (0: skip; see
        csrc/lora.c and pack_lora_module); scratch bf16 [M, >= every rank]."""
        if x.stride(1) != 1:
            x = x.contiguous()
        self._lora(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], nseg,
            bounds.data_ptr(), descs, scratch.data_ptr(), scratch.stride(0),
        )  # fmt: skip


def onednn_uses_amx() -> bool:
    """Whether torch's oneDNN matmul runs on AMX tiles on this CPU (it asks the OS for
    them; the CPU flag alone is not enough)."""
    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch._C._cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        return bool(probe())
    return b"amx_bf16" in _cpu_identity()


_GATED_RAW = 2  # linear.c's ZS_GATED_RAW


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → the pair layout csrc/lora.c reads, bf16 [ceil(K/2), N, 2]: the two
    consecutive k of one row side by side, K padded to even with a zero."""
    n, k = weight.shape
    w = weight.to(torch.bfloat16)
    if k % 2:
        w = torch.cat([w, w.new_zeros(n, 1)], dim=1)
    return w.view(n, -1, 2).transpose(0, 1).contiguous()


def pack_lora_module(
    a: torch.Tensor, subs: list[tuple[int, torch.Tensor]]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One adapter's module for `CpuKernels.lora`: A [R, K] (every sub-block's rank
    stacked, each even) and per sub-block (first output column, B [columns, rank]) →
    the description (int64, csrc/lora.c's layout) and the tensors it points into,
    which must stay alive as long as it is used."""
    a_pairs = pack_pairs(a)
    keep = [a_pairs]
    desc = [a.shape[0], a_pairs.data_ptr(), len(subs)]
    offset = 0
    for col, b in subs:
        b_pairs = pack_pairs(b)
        keep.append(b_pairs)
        desc += [col, b.shape[0], offset, b.shape[1], b_pairs.data_ptr()]
        offset += b.shape[1]
    if offset != a.shape[0] or offset % 2:
        raise ValueError(f"sub-block ranks {offset} must sum to A's rows {a.shape[0]}, even each")
    return torch.tensor(desc, dtype=torch.int64), keep


_loaded: dict[bool, CpuKernels | None] = {}


def load(portable: bool = False) -> CpuKernels | None:
    """The kernels for this machine (built on first use), or None where they cannot be
    built or loaded; the reason is logged once. `portable` skips the AVX-512 code."""
    if portable not in _loaded:
        try:
            path = build(portable)
            lib = ctypes.CDLL(str(path))
            if lib.zs_abi() != ABI:
                raise RuntimeError(f"{path} speaks ABI {lib.zs_abi()}, expected {ABI}")
            _loaded[portable] = CpuKernels(lib, path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("CPU kernels unavailable, the forward keeps torch's ops: %s", e)
            _loaded[portable] = None
    return _loaded[portable]


def build(portable: bool = False, source: Path = SOURCE_DIR) -> Path:
    """Compile csrc/*.c into one library for this CPU, in the cache (once; concurrent
    builders each write a private file and the last rename wins, so no one sees a
    partial one). `source`: another checkout's csrc (benchmarks compare builds)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-pthread", "-shared", "-fPIC", "-std=c11"]
    if portable:
        flags.append("-DZS_PORTABLE")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    sources = sorted(source.glob("*.c"))
    # Every source by name and content: a header counts as much as a .c.
    inputs = sorted([*sources, *source.glob("*.h")])
    files = [b"%s\0%s" % (p.name.encode(), p.read_bytes()) for p in inputs]
    key = hashlib.sha256(
        b"\0".join([*files, " ".join(flags).encode(), version.encode(), _cpu_identity()])
    ).hexdigest()[:16]
    folder = _cache_dir()
    path = folder / f"cpu_kernels-{key}.so"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, *map(str, sources), "-o", staging, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    logger.info("built CPU kernels %s", path)
    return path


def _cache_dir() -> Path:
    # XDG_CACHE_HOME is the standard place for rebuildable files; the default model
    # lives beside it (launcher/tiny_model.py).
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache) if cache else Path.home() / ".cache") / "zserve" / "kernels"


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "cpu family", "model\t"))]
    return "\n".join(sorted(set(keep))).encode()
