"""The CPU kernels (engine_core/csrc/) against torch doing the same math.

Both builds run: the one for this CPU (AVX-512 where it has it) and the portable C
that any other CPU gets. The fused elementwise kernels round where torch's bf16 ops
round, so they must agree with those ops to the last bit except where a sum's order
differs (at most one bf16 step, on few elements). Attention keeps its scores in fp32:
it is compared with an fp32 reference from the same bf16 inputs, within what one
rounding of the bf16 output allows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core import cpu_kernels
from engine_core.native_linear import Linear
from engine_core.native_llama import NativeLlamaBackend

pytestmark = pytest.mark.timeout(120)

BF16 = torch.bfloat16


@pytest.fixture(scope="module", params=[False, True], ids=["native", "portable"])
def kernels(request):
    k = cpu_kernels.load(portable=request.param)
    assert k is not None, "the CPU kernels did not build (see the log)"
    return k


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors of the same sign pattern."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor, max_frac_off: float = 0.01):
    off = _ulps(got, want)
    assert int(off.max()) <= 1, f"{int(off.max())} bf16 steps apart"
    assert float((off > 0).float().mean()) <= max_frac_off, float((off > 0).float().mean())


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 512), (130, 512), (3, 9000)])
def test_rms_norm_matches_torchs_bf16_ops(kernels, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(BF16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(BF16)
    _assert_bf16_close(kernels.rms_norm(x, w, 1e-6), _torch_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("hidden", [512, 1000])  # 1000: a last vector partly filled
def test_rms_norm_with_residual_adds_in_place_first(kernels, hidden):
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(33, hidden, generator=g).to(BF16)
    delta = torch.randn(33, hidden, generator=g).to(BF16)
    w = torch.randn(hidden, generator=g).to(BF16)
    expected_sum = residual + delta
    out = kernels.rms_norm(delta, w, 1e-5, residual=residual)
    assert torch.equal(residual, expected_sum)
    _assert_bf16_close(out, _torch_rms_norm(expected_sum, w, 1e-5))


def test_rms_norm_reads_strided_rows(kernels):
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 1024, generator=g).to(BF16)
    x = wide[:, 100:612]
    w = torch.randn(512, generator=g).to(BF16)
    _assert_bf16_close(kernels.rms_norm(x, w, 1e-6), _torch_rms_norm(x.contiguous(), w, 1e-6))


def _linear_kernels(kernels):
    if not kernels.has_linear:
        pytest.skip("the matmul is in the AVX512-BF16 build only (oneDNN's elsewhere)")
    return kernels


@pytest.mark.parametrize(
    "m,n,k,bias",
    [(1, 512, 512, False), (7, 40, 129, True), (8, 32, 64, False), (33, 2816, 512, True),
     (130, 100, 1408, False), (33, 2560, 4096, True)],
)  # fmt: skip
def test_linear_matches_an_fp64_reference(kernels, m, n, k, bias):
    # Every odd shape: rows past a multiple of 8, columns past a 32-column tile, an
    # odd K (its last pair half empty), a bias; and (K = 4096) a thread's tiles longer
    # than the weight its blocks of x pass over in turn (1 MB on the tile unit).
    kernels = _linear_kernels(kernels)
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = torch.randn(n, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    got = kernels.linear(x, kernels.pack_linear(w), None if b is None else b.float(), n)
    assert got.shape == (m, n) and got.dtype == BF16
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    # One bf16 rounding of the output, plus fp32 sums of k exact products.
    bound = want.abs() * 2**-8 + k * 2**-23 * (x.double().abs() @ w.double().abs().T)
    off = (got.double() - want).abs()
    assert bool((off <= bound).all()), float((off - bound).max())


@pytest.mark.parametrize("m,n,bias", [(1, 8192, False), (13, 100, True)])
def test_linear_with_fp32_out_is_the_bf16_result_widened(kernels, m, n, bias):
    # The LM head's logits: the same bf16-rounded values, as .float() would give them.
    kernels = _linear_kernels(kernels)
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, 96, generator=g).to(BF16)
    packed = kernels.pack_linear(torch.randn(n, 96, generator=g).to(BF16))
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.linear(x, packed, b, n, out_f32=True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got, kernels.linear(x, packed, b, n).float())
    with pytest.raises(ValueError, match="bf16 only"):
        kernels.linear(x, packed, None, n // 2, gated=True, out_f32=True)


@pytest.mark.parametrize("m", [1, 16, 17, 32, 33, 300])
def test_linear_agrees_with_torch_across_row_blocks(kernels, m):
    # K a multiple of 32 takes the tile unit where the CPU has AMX (32-row blocks, the
    # first 16 and the rest, 256-row passes); every variant against torch's ops.
    kernels = _linear_kernels(kernels)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g).to(BF16)
    w = torch.randn(70, 96, generator=g).to(BF16)
    b = torch.randn(70, generator=g).to(BF16)
    packed = kernels.pack_linear(w)
    got = kernels.linear(x, packed, b.float(), 70)
    _assert_bf16_close(got, F.linear(x, w, b), max_frac_off=0.05)
    assert torch.equal(kernels.linear(x, packed, b.float(), 70, out_f32=True), got.float())
    gate_up = torch.randn(2 * 40, 96, generator=g).to(BF16)
    gated = kernels.pack_linear(gate_up, gated=True)
    raw = kernels.linear(x, gated, None, 40, gated=True, raw=True)
    _assert_bf16_close(raw, F.linear(x, gate_up), max_frac_off=0.05)
    fused = kernels.linear(x, gated, None, 40, gated=True)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    _assert_bf16_close(fused, F.silu(gate) * up, max_frac_off=0.1)


def test_linear_reads_strided_rows_and_agrees_with_torch(kernels):
    kernels = _linear_kernels(kernels)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 700, generator=g).to(BF16)
    x = wide[:, 50:562]
    w = torch.randn(96, 512, generator=g).to(BF16)
    got = kernels.linear(x, kernels.pack_linear(w), None, 96)
    _assert_bf16_close(got, F.linear(x.contiguous(), w), max_frac_off=0.05)


def test_a_layer_takes_the_kernels_matmul_where_it_runs_fast():
    # On AMX a K off the tiles' steps of 32 keeps oneDNN's matmul; the answers agree.
    from engine_core.native_linear import Linear

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.prefer_linear:
        pytest.skip("the kernels' matmul is not the forward's here")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 96, generator=g).to(BF16)
    for k in (96, 80):
        w = torch.randn(48, k, generator=g).to(BF16)
        layer = Linear(w.clone(), kernels=kernels)
        assert layer.fused == (not kernels.linear_amx or k % 32 == 0)
        _assert_bf16_close(layer(x[:, :k].contiguous()), F.linear(x[:, :k], w), max_frac_off=0.05)


@pytest.mark.parametrize("m,inter,k", [(1, 1408, 512), (9, 40, 65), (33, 16, 64)])
def test_gated_linear_is_silu_mul_of_the_projection(kernels, m, inter, k):
    # The gate/up matmul with SiLU·mul fused: the same bf16 values as the projection
    # followed by torch's silu and product, but for the order of the matmul's sums.
    kernels = _linear_kernels(kernels)
    g = torch.Generator().manual_seed(m + inter)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = torch.randn(2 * inter, k, generator=g).to(BF16)
    got = kernels.linear(x, kernels.pack_linear(w, gated=True), None, inter, gated=True)
    assert got.shape == (m, inter)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    _assert_bf16_close(got, F.silu(gate) * up, max_frac_off=0.1)


def test_the_gate_up_layer_gives_silu_mul_on_every_path():
    # The backend's gate/up layer: the fused matmul (AVX512-BF16), oneDNN then the
    # portable kernels' silu_mul, oneDNN then torch's ops.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 256, generator=g).to(BF16)
    w = torch.randn(2 * 96, 256, generator=g).to(BF16)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    want = F.silu(gate) * up
    for kernels in (cpu_kernels.load(), cpu_kernels.load(portable=True), None):
        layer = Linear(w, kernels=kernels, silu_mul=True)
        assert layer.fused == (kernels is not None and kernels.prefer_linear)
        _assert_bf16_close(layer(x), want, max_frac_off=0.1)


@pytest.mark.parametrize("rows,inter", [(1, 128), (64, 1408), (200, 1408)])
def test_silu_mul_matches_torchs_bf16_ops(kernels, rows, inter):
    g = torch.Generator().manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=g)).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_bf16_close(kernels.silu_mul(gate_up), F.silu(gate) * up)


def _cache(blocks: int, hkv: int, bs: int, d: int, g: torch.Generator):
    k = torch.randn(blocks, hkv, bs, d, generator=g).to(BF16)
    v = torch.randn(blocks, hkv, bs, d, generator=g).to(BF16)
    return k, v


@pytest.mark.parametrize(
    "hq,hkv,d,qk_norm",
    [(8, 2, 64, False), (8, 2, 64, True), (4, 2, 128, False), (4, 2, 16, False), (4, 2, 16, True)],
)
def test_rope_store_rotates_q_in_place_and_writes_k_v_to_their_slots(kernels, hq, hkv, d, qk_norm):
    g = torch.Generator().manual_seed(d)
    n, bs, blocks = 11, 4, 9
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(BF16)
    original = qkv.clone()
    positions = torch.randint(0, 50, (n,), generator=g)
    angles = torch.arange(64)[:, None] * torch.rand(1, d // 2, generator=g)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(BF16)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(BF16)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    k_cache, v_cache = _cache(blocks, hkv, bs, d, g)
    q_norm = torch.randn(d, generator=g).to(BF16) if qk_norm else None
    k_norm = torch.randn(d, generator=g).to(BF16) if qk_norm else None
    kernels.rope_store(
        qkv, positions, cos, sin, hq, hkv, d, k_cache, v_cache, slots, q_norm, k_norm, 1e-6
    )

    c, s = cos[positions][:, None], sin[positions][:, None]
    q = original[:, : hq * d].view(n, hq, d)
    k = original[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    if qk_norm:
        q, k = _torch_rms_norm(q, q_norm, 1e-6), _torch_rms_norm(k, k_norm, 1e-6)
    _assert_bf16_close(qkv[:, : hq * d].view(n, hq, d), NativeLlamaBackend._rope(q, c, s))
    assert torch.equal(qkv[:, hq * d :], original[:, hq * d :])  # k and v rows untouched
    block, offset = slots // bs, slots % bs
    _assert_bf16_close(k_cache[block, :, offset], NativeLlamaBackend._rope(k, c, s))
    v = original[:, (hq + hkv) * d :].view(n, hkv, d)
    assert torch.equal(v_cache[block, :, offset], v)


def _reference_attention(
    q, k_cache, v_cache, tables, row_table, row_len, hq, scale, window, softcap
):
    """fp32 attention of each query row over its sequence's first row_len positions."""
    _, hkv, bs, d = k_cache.shape
    out = torch.empty(q.shape[0], hq, d)
    for n in range(q.shape[0]):
        length = int(row_len[n])
        pos = torch.arange(length)
        table = tables[int(row_table[n])].long()
        keys = k_cache[table[pos // bs], :, pos % bs].float()  # [L, Hkv, D]
        values = v_cache[table[pos // bs], :, pos % bs].float()
        keep = torch.ones(length, dtype=torch.bool)
        if window:
            keep &= pos > length - 1 - window
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = keys[:, kv] @ q[n].view(hq, d)[h].float() * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=0)
            out[n, h] = probs @ values[:, kv]
    return out.view(q.shape[0], hq * d)


@pytest.mark.parametrize(
    "hq,hkv,d,window,softcap",
    [
        (8, 2, 64, None, None),  # the small llama
        (4, 2, 16, None, None),  # the tiny test models
        (4, 4, 16, None, None),  # no GQA
        (12, 2, 48, 5, None),  # a head_dim that is no multiple of 32, a sliding window
        (16, 1, 128, None, 30.0),  # soft-capped scores
        (8, 2, 64, 21, None),  # a window on the tiles' shapes
        (14, 2, 128, None, None),  # 7 query heads per KV head
    ],
)
@pytest.mark.parametrize("bs", [4, 16])  # 16: the engine's blocks, rows of many blocks
def test_paged_attention_matches_an_fp32_reference(kernels, hq, hkv, d, window, softcap, bs):
    g = torch.Generator().manual_seed(hq * d)
    blocks = 40
    k_cache, v_cache = _cache(blocks, hkv, bs, d, g)
    # Three sequences with scattered blocks; rows: one decode each plus a prefill chunk.
    tables = torch.randperm(blocks - 1, generator=g)[:30].add(1).view(3, 10).to(torch.int32)
    row_table = torch.tensor([0, 1, 2, 2, 2, 2], dtype=torch.int32)
    first, chunk = (37, 20) if bs == 4 else (150, 45)  # up to 10 blocks each
    row_len = torch.tensor([first, 1, chunk, chunk + 1, chunk + 2, chunk + 3], dtype=torch.int32)
    wide = torch.randn(6, 3 * hq * d, generator=g).to(BF16)
    q = wide[:, hq * d : 2 * hq * d]  # strided rows, as q sits inside the qkv rows
    scale = d**-0.5
    out = kernels.paged_attention(
        q, k_cache, v_cache, tables, row_table, row_len, hq, scale, window, softcap, first
    )
    want = _reference_attention(
        q, k_cache, v_cache, tables, row_table, row_len, hq, scale, window, softcap
    )
    torch.testing.assert_close(out.float(), want, atol=4e-3, rtol=8e-3)


def _tiles_and_walks(args, hq, hkv, d, bs):
    """The kernels' attention of `args` with the tiles, then on the row walks alone,
    and the fp32 reference; skips where there are no tiles for this shape."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.tiled_attention(hq, hkv, d, bs):
        pytest.skip("the tiled attention needs the AVX-512 build")
    tiled = kernels.paged_attention(*args)
    kernels.enable_tiled_attention(False)
    try:
        walked = kernels.paged_attention(*args)
    finally:
        kernels.enable_tiled_attention(True)
    return tiled, walked, _reference_attention(*args[:-1])


@pytest.mark.parametrize(
    "hq,hkv,d,window,softcap",
    [
        (8, 2, 64, None, None),  # the small llama
        (8, 2, 64, 21, None),  # a sliding window
        (16, 1, 128, None, 30.0),  # soft-capped scores, 16 query heads a tile
        (14, 2, 128, None, None),  # 7 query heads per KV head
        (4, 4, 32, None, None),  # no GQA
    ],
)
@pytest.mark.parametrize("bs", [16, 32])
def test_prompt_chunks_on_the_tiles_match_an_fp32_reference(hq, hkv, d, window, softcap, bs):
    # Rows: a decode, a 70-row chunk after 300 cached positions (two work items of the
    # tiles), a 5-row chunk (below TILED_MIN_ROWS: row walks), a 9-row fresh prompt.
    # The tiles round the probabilities to bf16 (as SDPA does), so they sit a little
    # further from the fp32 reference than the walks; both paths must meet it.
    g = torch.Generator().manual_seed(hq * d + bs)
    blocks = 200 if bs == 16 else 100
    k_cache, v_cache = _cache(blocks, hkv, bs, d, g)
    per = blocks // 4
    tables = torch.randperm(blocks - 1, generator=g)[: 3 * per].add(1).view(3, per).to(torch.int32)
    row_table = torch.tensor([0] + [1] * 70 + [0] * 5 + [2] * 9, dtype=torch.int32)
    lens = [500] + list(range(301, 371)) + list(range(40, 45)) + list(range(1, 10))
    row_len = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 3 * hq * d, generator=g).to(BF16)[:, hq * d : 2 * hq * d]
    args = (q, k_cache, v_cache, tables, row_table, row_len, hq, d**-0.5, window, softcap, 500)
    tiled, walked, want = _tiles_and_walks(args, hq, hkv, d, bs)
    torch.testing.assert_close(tiled.float(), want, atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(walked.float(), want, atol=4e-3, rtol=8e-3)
    chunk = slice(1, 71)
    assert not torch.equal(tiled[chunk], walked[chunk]), "the chunk did not take the tiles"
    assert torch.equal(tiled[71:76], walked[71:76]), "a run under TILED_MIN_ROWS took the tiles"


@pytest.mark.parametrize(
    "hq,hkv,d,softcap,bs",
    [(8, 2, 64, None, 16), (16, 1, 128, 30.0, 16), (14, 2, 128, None, 32), (4, 4, 32, None, 16)],
)
def test_decode_rows_sharing_a_cached_prefix_attend_to_it_on_the_tiles(hq, hkv, d, softcap, bs):
    # Nine sequences over three 160-token prefixes (the same leading blocks, as the prefix
    # cache shares them), each with blocks of its own after; a tenth shares only 32 keys
    # with the first three (under ZS_SHARED_MIN_KEYS: that whole group walks), and a 9-row
    # chunk rides along on the tiles. The shared groups' rows must meet the fp32
    # reference (their prefix on tiles, P in bf16, merged with their own keys' walk).
    g = torch.Generator().manual_seed(hq * d + bs)
    k_cache, v_cache = _cache(600, hkv, bs, d, g)
    perm = torch.randperm(599, generator=g).add(1).tolist()
    per = 160 // bs
    prefixes = [perm[i * per : (i + 1) * per] for i in range(3)]
    rest = perm[3 * per :]
    tabs = [prefixes[i % 3] + rest[i * 12 : (i + 1) * 12] for i in range(9)]
    tabs.append(prefixes[0][: 32 // bs] + rest[200:212])
    width = max(len(t) for t in tabs)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tabs], dtype=torch.int32)
    row_table = torch.tensor(list(range(10)) + [4] * 9, dtype=torch.int32)
    lens = [161, 170, 200, 250, 201, 300, 163, 180, 190, 60] + list(range(60, 69))
    row_len = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 3 * hq * d, generator=g).to(BF16)[:, hq * d : 2 * hq * d]
    args = (q, k_cache, v_cache, tables, row_table, row_len, hq, d**-0.5, None, softcap, 300)
    tiled, walked, want = _tiles_and_walks(args, hq, hkv, d, bs)
    torch.testing.assert_close(tiled.float(), want, atol=4e-3, rtol=1e-2)
    differ = [n for n in range(len(lens)) if not torch.equal(tiled[n], walked[n])]
    assert differ == [1, 2, 4, 5, 7, 8, *range(10, 19)], differ


@pytest.mark.parametrize(
    "hq,hkv,d",
    [(8, 2, 64), (14, 2, 128), (4, 4, 32), (12, 3, 96), (32, 2, 64)],  # gp 4, 8, 4, 4, 16
)
def test_long_decode_rows_match_an_fp32_reference(kernels, hq, hkv, d):
    # Long rows against the fp32 reference (csrc/row_walk.c): an odd key count, a last
    # block partly filled, a sliding window starting at a block's first key and one
    # that does not, and short rows beside them.
    g = torch.Generator().manual_seed(hq * d + 7)
    k_cache, v_cache = _cache(300, hkv, 16, d, g)
    tables = torch.randperm(299, generator=g)[:256].add(1).view(4, 64).to(torch.int32)
    row_table = torch.tensor([0, 1, 2, 3, 0, 3], dtype=torch.int32)
    row_len = torch.tensor([384, 385, 1000, 1024, 100, 1021], dtype=torch.int32)
    q = torch.randn(6, 3 * hq * d, generator=g).to(BF16)[:, hq * d : 2 * hq * d]
    for window in (None, 512):
        args = (q, k_cache, v_cache, tables, row_table, row_len, hq, d**-0.5, window, None)
        out = kernels.paged_attention(*args, 1024)
        torch.testing.assert_close(out.float(), _reference_attention(*args), atol=4e-3, rtol=8e-3)


def test_both_builds_agree_on_attention_to_rounding():
    native, portable = cpu_kernels.load(), cpu_kernels.load(portable=True)
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache = _cache(20, 2, 16, 64, g)
    tables = torch.arange(1, 17, dtype=torch.int32).view(2, 8)
    row_table = torch.tensor([0, 1], dtype=torch.int32)
    row_len = torch.tensor([100, 128], dtype=torch.int32)
    q = torch.randn(2, 8 * 64, generator=g).to(BF16)
    args = (q, k_cache, v_cache, tables, row_table, row_len, 8, 0.125, None, None, 128)
    a, b = native.paged_attention(*args), portable.paged_attention(*args)
    assert int(_ulps(a, b).max()) <= 1


def test_shapes_beyond_the_kernels_are_named():
    assert cpu_kernels.CpuKernels.supports(8, 2, 64) is None
    assert "head_dim 512" in cpu_kernels.CpuKernels.supports(8, 2, 512)
    assert "32 query heads over 1" in cpu_kernels.CpuKernels.supports(32, 1, 64)


@pytest.mark.parametrize("vocab", [7, 16, 300, 8192])
def test_softmax_draw_gives_each_token_its_share_of_the_unit_interval(kernels, vocab):
    # Uniforms on an even grid: token t must take a share of the draws equal to its
    # probability, to within one grid step at each end of its interval.
    g = torch.Generator().manual_seed(vocab)
    logits = 2 * torch.randn(1, vocab, generator=g)
    logits[0, ::3] = float("-inf")  # excluded tokens
    n = 20_000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    tokens = kernels.softmax_draw(logits.expand(n, vocab).contiguous(), u)
    counts = torch.bincount(tokens, minlength=vocab).float()
    probs = torch.softmax(logits[0].double(), dim=0)
    assert counts[::3].sum() == 0, "an excluded token was drawn"
    assert (counts - n * probs).abs().max() <= 2.0
    # The draw is monotone in u: inverse-CDF order.
    assert bool((tokens[1:] >= tokens[:-1]).all())


def test_softmax_draw_edges_never_pick_a_token_without_mass(kernels):
    logits = torch.full((4, 40), float("-inf"))
    logits[:, 5] = 0.0
    logits[:, 39] = 0.0  # mass only in the first and the last block
    u = torch.tensor([0.0, 0.4999, 0.5001, 1.0 - 2.0**-24])
    assert kernels.softmax_draw(logits, u).tolist() == [5, 5, 39, 39]
    single = torch.full((1, 33), float("-inf"))
    single[0, 32] = 3.0  # the only token sits alone in a tail block
    assert kernels.softmax_draw(single, torch.tensor([0.999999])).tolist() == [32]
    # Mass in the first and third 256-token spans only (the draw finds the span, then
    # the 16-token block, then the token).
    spread = torch.full((4, 700), float("-inf"))
    spread[:, 5] = 0.0
    spread[:, 600] = 0.0
    assert kernels.softmax_draw(spread, u).tolist() == [5, 5, 600, 600]


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 17), (32, 8192), (5, 151_936)])
def test_argmax_is_torchs(kernels, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1))
    strided = torch.randn(rows, vocab + 9, generator=g)[:, :vocab]
    assert torch.equal(kernels.argmax(strided), strided.argmax(dim=-1))


def test_argmax_edges_ties_infinities_and_nans_as_torch(kernels):
    logits = torch.full((5, 100), float("-inf"))
    logits[1, [5, 50, 99]] = 3.0  # a tie: the first
    logits[2, 3], logits[2, 70] = 1e30, float("nan")  # a NaN beats any number
    logits[3, [0, 99]] = float("nan")
    logits[4, 17], logits[4, 18] = float("inf"), float("inf")
    assert kernels.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert kernels.argmax(logits).tolist() == [0, 5, 70, 0, 17]


@pytest.mark.parametrize("vocab", [8192, 320, 47])
def test_apply_bitmask_masks_exactly_the_cleared_bits_of_the_listed_rows(kernels, vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(0, 2, (6, words * 32), generator=g, dtype=torch.int64)
    bits[1] = 1  # every token allowed
    bits[2] = 0  # none
    bits[3, ::2] = 0  # words neither full nor empty
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    bitmask = (bits.view(6, words, 32) * weights).sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    full = torch.randn(6, vocab + 5, generator=g)
    logits = full[:, :vocab]  # strided rows, as the step's sampling rows are
    before, tail = logits.clone(), full[:, vocab:].clone()
    rows = [0, 1, 2, 3, 5]
    kernels.apply_bitmask(logits, bitmask, rows)
    want = before.clone()
    for r in rows:
        want[r][bits[r, :vocab] == 0] = float("-inf")
    assert torch.equal(logits, want)
    assert torch.equal(full[:, vocab:], tail)  # nothing written past a row's vocabulary
