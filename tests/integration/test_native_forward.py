"""The native Llama-family forward against transformers' forward, on the same batches."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch
from engine_oracle import SMALL_KV, greedy, make_prompts

from engine_core import native_llama
from engine_core.attention import StepBatch
from engine_core.cpu_kernels import TILED_MIN_ROWS
from engine_core.cpu_kernels import load as load_kernels
from engine_core.hf_backend import TransformersBackend
from engine_core.llm import LLM
from engine_core.model_loader import load_model
from engine_core.native_llama import NativeLlamaBackend
from protocol.messages import EngineCoreRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

# fp32: the native path does transformers' arithmetic operation for operation, so the
# logits agree to float rounding of differently fused matmuls (seen: exactly equal).
FP32_ATOL = 1e-4
# bf16 (the benchmark model): one bf16 ulp of a logit of magnitude ~4 is 0.03.
BF16_ATOL = 0.1
# bf16 on the tiny random models over a few hundred positions.
TINY_BF16_ATOL = 0.25


class _Both:
    """Runs transformers' forward and the native one on every step, each on the step
    tensors the runner builds for it (the CPU kernels take their own metadata form),
    and keeps the largest logit gap. transformers runs first; the native forward then
    writes its own K/V, which both read on later steps."""

    def __init__(self, runner, reference) -> None:
        self.runner, self.native, self.reference = runner, runner.backend, reference
        self.gaps: list[float] = []
        self.tiled_chunks = 0  # prefill chunks the kernel path gave to a tiled attention
        self.shared_steps = 0  # steps with rows whose block tables start alike

    def execute(self, plan):
        runner = self.runner
        runner.backend = self.reference
        expected = self.reference.forward(*runner.prepare(plan))
        runner.backend = self.native
        args = runner.prepare(plan)
        if args[2].rows is not None:
            self.tiled_chunks += len(args[2].prefills) or self._chunks_on_tiles(plan)
            firsts = args[2].rows.tables[:, 0].tolist()
            self.shared_steps += len(set(firsts)) < len(firsts)
        got = self.native.forward(*args)
        if got.numel():  # a step of partial chunks only samples nothing
            self.gaps.append((expected - got).abs().max().item())
        return got

    def _chunks_on_tiles(self, plan) -> int:
        """The step's chunks that the kernels' own tiles take (AVX-512 builds)."""
        native = self.native
        shape = (native.num_heads, native.num_kv_heads, native.head_dim, 16)
        if not native.kernels.tiled_attention(*shape):
            return 0
        return sum(n >= TILED_MIN_ROWS for n in plan.num_tokens)


def _compare(
    model_dir,
    dtype: str | None = None,
    cpu_kernels: str = "auto",
    prompts: list[list[int]] | None = None,
    budget: int = 24,
    chunk: int = 7,
    device: str = "auto",
) -> _Both:
    # A small budget and chunk cap: steps mix decodes, fresh prompts and continued chunks.
    kwargs = dict(
        kv_cache_memory_bytes=SMALL_KV,
        model_impl="native",
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=chunk,
        cpu_kernels=cpu_kernels,
        device=device,
    )
    if dtype:
        kwargs["dtype"] = dtype
    llm = LLM(str(model_dir), **kwargs)
    runner = llm.engine.runner
    assert isinstance(runner.backend, NativeLlamaBackend)
    assert (runner.backend.kernels is not None) == (
        cpu_kernels == "auto" and runner.dtype == torch.bfloat16 and runner.device.type == "cpu"
    )
    reference = TransformersBackend(load_model(runner.info, runner.dtype, runner.device))
    both = _Both(runner, reference)
    runner.execute = both.execute
    llm.generate(prompts or make_prompts(), greedy())
    assert len(both.gaps) > 10
    return both


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_native_logits_match_transformers_fp32(tiny_model, arch):
    gaps = _compare(tiny_model(arch)).gaps
    assert max(gaps) <= FP32_ATOL, max(gaps)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_native_logits_match_transformers_on_the_bf16_benchmark_model(small_model, cpu_kernels):
    gaps = _compare(small_model, "bfloat16", cpu_kernels).gaps
    assert max(gaps) <= BF16_ATOL, max(gaps)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_long_chunks_take_the_tiled_attention_as_exactly_as_the_row_walks(
    tiny_model, arch, monkeypatch
):
    # Chunks of up to 160 rows: fresh ones and continued ones (their context partly in
    # the cache) are long enough for SDPA's tiled attention, the short tails and the
    # decodes stay on the kernel's row walks, in the same steps; mistral's sliding
    # window (16) masks the tiled chunks too. Over 300-token contexts a tiny bf16 model
    # drifts from transformers' bf16 by ~0.15 either way; the tiled path must drift
    # no more than the row walks do on the same steps. The CPU kernels' path: on CPU.
    prompts = make_prompts((300, 200, 5, 170, 33), seed=3)
    run = dict(prompts=prompts, budget=256, chunk=160, device="cpu")
    tiled = _compare(tiny_model(arch), "bfloat16", **run)
    monkeypatch.setattr(native_llama, "DENSE_MIN_ROWS", 1 << 30)
    walks = _compare(tiny_model(arch), "bfloat16", **run)
    assert tiled.tiled_chunks >= 4 and walks.tiled_chunks == 0
    assert max(tiled.gaps) <= TINY_BF16_ATOL, max(tiled.gaps)
    mean = statistics.fmean
    assert mean(tiled.gaps) <= 1.2 * mean(walks.gaps), (mean(tiled.gaps), mean(walks.gaps))


def _tiles_then_walks(model_dir, monkeypatch, **run) -> tuple[_Both, _Both]:
    """The benchmark model against transformers with the kernels' tiles, then with
    every row on the row walks (no tiles, no SDPA); the tiles must drift no more than
    the walks. Skips where there are no tiles (they need head_dim a multiple of 32: the
    benchmark model's 64; the tiny models have 16)."""
    kernels = load_kernels()
    if kernels is None or not kernels.tiled_attention(8, 2, 64, 16):
        pytest.skip("the kernels' tiled attention needs the AVX-512 build")
    tiled = _compare(model_dir, "bfloat16", device="cpu", **run)
    monkeypatch.setattr(native_llama, "DENSE_MIN_ROWS", 1 << 30)
    kernels.enable_tiled_attention(False)
    try:
        walks = _compare(model_dir, "bfloat16", device="cpu", **run)
    finally:
        kernels.enable_tiled_attention(True)
    mean = statistics.fmean
    assert max(tiled.gaps) <= BF16_ATOL, max(tiled.gaps)
    assert mean(tiled.gaps) <= 1.2 * mean(walks.gaps), (mean(tiled.gaps), mean(walks.gaps))
    return tiled, walks


def test_chunks_on_the_kernels_own_tiles_drift_no_more_than_the_row_walks(small_model, monkeypatch):
    # The AVX-512 build's tiled attention (csrc/tiled_attention.c) takes every run of 8 or
    # more rows of one sequence: fresh and continued chunks of up to 160 rows beside
    # decodes, each step against transformers' bf16 forward.
    prompts = make_prompts((300, 200, 5, 170, 33), seed=3)
    tiled, walks = _tiles_then_walks(
        small_model, monkeypatch, prompts=prompts, budget=256, chunk=160
    )
    assert tiled.tiled_chunks >= 4 and walks.tiled_chunks == 0


def test_decode_rows_of_a_cached_prefix_on_the_tiles_drift_no_more_than_the_row_walks(
    small_model, monkeypatch
):
    # Five prompts behind one 200-token prefix (the prefix cache shares its blocks), 24
    # tokens each: their decode rows attend to the shared blocks together on the tiles
    # (csrc/paged_attention.c: tiled_then_walked), then walk their own keys.
    prefix = make_prompts((200,), seed=5)[0]
    prompts = [prefix + tail for tail in make_prompts((3, 9, 17, 30, 41), seed=6)]
    tiled, _ = _tiles_then_walks(small_model, monkeypatch, prompts=prompts, budget=512, chunk=512)
    assert tiled.shared_steps >= 10


def _first_step_logits(model_dir, cpu_kernels: str) -> dict[str, torch.Tensor]:
    """bf16 logits of the first step (fresh prompts only) from the native path, from
    transformers in bf16, and from transformers in fp32 (the truth both round)."""
    llm = LLM(
        str(model_dir),
        kv_cache_memory_bytes=SMALL_KV,
        model_impl="native",
        dtype="bfloat16",
        cpu_kernels=cpu_kernels,
    )
    runner, logits = llm.engine.runner, {}
    native = runner.backend
    # Every linear layer takes the kernels' matmul where they prefer it (not on AMX).
    linears = [native.lm_head] + [
        lin for layer in native.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    matmul = native.kernels is not None and native.kernels.prefer_linear
    assert all(lin.fused == matmul for lin in linears)
    references = {
        "bf16": TransformersBackend(load_model(runner.info, torch.bfloat16, runner.device)),
        "fp32": TransformersBackend(load_model(runner.info, torch.float32, runner.device)),
    }
    plan = llm.engine.scheduler
    for prompt in make_prompts():
        llm.engine.add_request(
            EngineCoreRequest(f"p{len(plan.waiting)}", prompt, SamplingParams(max_tokens=1), 0.0)
        )
    step = plan.schedule()
    assert all(r.num_computed_tokens == 0 for r in step.requests)
    for name, backend in references.items():
        runner.backend = backend
        ids, positions, meta, rows = runner.prepare(step)
        # Each reference gets a scratch cache of its own dtype: fresh prompts read
        # only the K/V they write.
        meta.kv_caches = [
            (k.to(backend.model.dtype), v.to(backend.model.dtype)) for k, v in meta.kv_caches
        ]
        logits[name] = backend.forward(ids, positions, meta, rows)
    runner.backend = native
    logits["native"] = native.forward(*runner.prepare(step))
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_native_bf16_with_the_cpu_kernels_is_as_close_to_fp32_as_transformers_bf16(
    tiny_model, arch
):
    # The kernels round in other places than transformers' bf16 ops (attention keeps
    # fp32 scores), so the two bf16 paths differ by about twice bf16's own error;
    # what must hold is that the kernels' error is no larger than transformers'.
    logits = _first_step_logits(tiny_model(arch), "auto")
    truth = logits["fp32"]
    kernel_gap = (logits["native"] - truth).abs()
    hf_gap = (logits["bf16"] - truth).abs()
    assert kernel_gap.max() <= 1.5 * hf_gap.max(), (kernel_gap.max(), hf_gap.max())
    assert kernel_gap.mean() <= 1.2 * hf_gap.mean(), (kernel_gap.mean(), hf_gap.mean())


def test_auto_takes_the_native_path_where_it_exists(tiny_model):
    assert isinstance(
        LLM(str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV).engine.runner.backend,
        NativeLlamaBackend,
    )
    assert isinstance(
        LLM(str(tiny_model("phi3")), kv_cache_memory_bytes=SMALL_KV).engine.runner.backend,
        TransformersBackend,
    )


def test_native_is_refused_clearly_for_other_architectures(tiny_model):
    with pytest.raises(ValueError, match=r"not available for this model.*Phi3ForCausalLM"):
        LLM(str(tiny_model("phi3")), kv_cache_memory_bytes=SMALL_KV, model_impl="native")


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_only_the_transformers_forward_imports_transformers_modeling_code(tiny_model, impl):
    # transformers' modeling_utils brings torch._dynamo and triton: 0.4-1.7 s of CPU in an
    # engine's start-up, which the native forward has no use for (its RoPE
    # tables: rope.py; the paged attention registers when a transformers model loads). A
    # fresh interpreter: this one imported transformers' models for the oracle.
    heavy = ("transformers.modeling_utils", "torch._dynamo", "triton")
    code = (
        "import sys; from engine_core.llm import LLM; "
        f"LLM({str(tiny_model('llama'))!r}, kv_cache_memory_bytes={SMALL_KV}, model_impl={impl!r}); "
        f"print(sorted(set(sys.modules) & set({heavy!r})))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = run.stdout.strip().splitlines()[-1]
    if impl == "native":
        assert loaded == "[]"
    else:
        assert "transformers.modeling_utils" in loaded


def test_rope_tables_match_transformers_positions(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), kv_cache_memory_bytes=SMALL_KV, model_impl="native")
    backend = llm.engine.runner.backend
    assert backend.cos.shape == (llm.engine.max_model_len, backend.head_dim)
    assert torch.isfinite(backend.cos).all() and torch.isfinite(backend.sin).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_layers_in_one_kernel_call_equal_the_per_op_forward(tiny_model, arch):
    # cpu_decoder.FusedDecoder chains the same kernels in C: on every step the forward
    # in one call (the embedding, the layers, the LM head) runs first, then the per-op
    # one (which writes the same K/V again), and their logits must be equal bit for bit;
    # qwen2 has QKV biases, qwen3 q/k norms, mistral a sliding window. Steps mix decodes
    # and short prompt chunks.
    llm = LLM(
        str(tiny_model(arch)), kv_cache_memory_bytes=SMALL_KV, model_impl="native",
        dtype="bfloat16", device="cpu", max_num_batched_tokens=24, long_prefill_token_threshold=7,
    )  # fmt: skip
    runner = llm.engine.runner
    native = runner.backend
    if native.kernels is None or native.kernels.decoder is None:
        pytest.skip("the decoder call is in the AVX512-BF16 build only")
    decoder = native.decoder
    assert decoder is not None
    for layer in native.layers:  # from_config zeroes biases: give them values to get wrong
        if layer.qkv.bias_f32 is not None:
            layer.qkv.bias_f32.copy_(torch.randn_like(layer.qkv.bias_f32))
    fused_steps = []

    def execute(plan):
        args = runner.prepare(plan)
        fused = native.forward(*args)
        native.decoder = None
        per_op = native.forward(*runner.prepare(plan))
        native.decoder = decoder
        if not args[2].prefills:
            fused_steps.append(plan)
        assert torch.equal(fused, per_op)
        return per_op

    runner.execute = execute
    llm.generate(make_prompts(), greedy())
    assert len(fused_steps) > 10

    # A token id past the embedding, or a logits row past the step, is refused before
    # anything is computed.
    ids = torch.tensor([native.embed.shape[0]])
    meta = native.attention_metadata(StepBatch([([1], 0, 1)], 1, torch.tensor([0])), runner.cache)
    with pytest.raises(IndexError, match="not in the embedding"):
        decoder.logits(ids, torch.tensor([0]), meta.rows, meta.kv_caches, torch.tensor([0]))
    with pytest.raises(IndexError, match="logits row 1 of a 1-row step"):
        decoder.logits(ids - 1, torch.tensor([0]), meta.rows, meta.kv_caches, torch.tensor([1]))


def test_the_one_call_writes_only_inside_the_scratch_it_asks_for(tiny_model):
    # Each step runs on buffers of exactly the size zs_decoder_scratch names, with a
    # canary after them: the call must leave the canary alone. 96 prompts whose chunks
    # share steps with ~90 decode rows: the last layer then gathers that many sampled
    # rows among more, the largest part of the scratch.
    llm = LLM(
        str(tiny_model("llama")), kv_cache_memory_bytes=SMALL_KV, model_impl="native",
        dtype="bfloat16", device="cpu", max_num_batched_tokens=160, long_prefill_token_threshold=9,
    )  # fmt: skip
    runner = llm.engine.runner
    native = runner.backend
    decoder = native.decoder
    if decoder is None:
        pytest.skip("the decoder call is in the AVX512-BF16 build only")
    canary = torch.tensor(-1234.0, dtype=torch.bfloat16)
    kept_rows = []

    def execute(plan):
        args = runner.prepare(plan)
        n, m = args[0].shape[0], args[3].shape[0]
        need = 2 * n * decoder.hidden + decoder.scratch_len(n, m)
        room = torch.full((need + 4096,), canary.item(), dtype=torch.bfloat16)
        decoder._buffers = room[:need]
        out = native.forward(*args)
        assert torch.equal(room[need:], torch.full((4096,), canary.item(), dtype=torch.bfloat16))
        if m < n:
            kept_rows.append(m)
        return out

    runner.execute = execute
    llm.generate(make_prompts(tuple(12 + i % 9 for i in range(96))), greedy(16))
    assert max(kept_rows) >= 64
