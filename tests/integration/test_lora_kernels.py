"""The CPU kernels' segmented LoRA matmul (csrc/lora.c) against torch, and the native bf16
forward with adapters against transformers + PEFT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_oracle import SMALL_KV, make_prompts
from hf_generate import reference_model
from peft import PeftModel

from engine_core import cpu_kernels
from engine_core.llm import LLM
from engine_core.native_lora import LoraRows
from launcher.tiny_lora import build_tiny_lora
from protocol.messages import EngineCoreRequest, LoraConfig, LoraModule, SamplingParams

pytestmark = pytest.mark.timeout(120)
BF16 = torch.bfloat16

BUILDS = [pytest.param(False, id="avx512"), pytest.param(True, id="portable")]


def kernels_or_skip(portable: bool) -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load(portable=portable)
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    return kernels


def module(k: int, parts: list[tuple[int, int, int]], g: torch.Generator):
    """A random adapter module: parts of (first column, columns, rank)."""
    a = (torch.randn(sum(r for _, _, r in parts), k, generator=g) * 0.2).to(BF16)
    subs = [(col, (torch.randn(n, r, generator=g) * 0.2).to(BF16)) for col, n, r in parts]
    return a, subs


def reference(x, y, bounds, modules):
    """torch's bf16 ops, segment by segment: y[rows, cols] += (x Aᵀ)[:, its ranks] Bᵀ."""
    want = y.clone()
    for s, m in enumerate(modules):
        if m is None:
            continue
        a, subs = m
        lo, hi = bounds[s], bounds[s + 1]
        t, first = x[lo:hi] @ a.t(), 0
        for col, b in subs:
            r = b.shape[1]
            want[lo:hi, col : col + b.shape[0]] += t[:, first : first + r] @ b.t()
            first += r
    return want


@pytest.mark.parametrize("portable", BUILDS)
@pytest.mark.parametrize(
    ("k", "n", "segments"),
    [
        # one decode row of a fused qkv (q 64, k 16, v 16 columns)
        (64, 96, [(1, [(0, 64, 8), (64, 16, 8), (80, 16, 8)])]),
        # odd k, base-model rows between two adapters, parts that leave columns alone
        (99, 80, [(3, None), (11, [(0, 40, 4), (50, 20, 6)]), (5, None), (18, [(10, 61, 16)])]),
        # a prefill of gate/up rows and decodes of another adapter, rank 64
        (512, 1408, [(130, [(0, 704, 16), (704, 704, 16)]), (9, [(0, 1408, 64)])]),
    ],
)
def test_lora_kernel_matches_torchs_bf16_ops_segment_by_segment(portable, k, n, segments):
    kernels = kernels_or_skip(portable)
    g = torch.Generator().manual_seed(k)
    modules = [None if parts is None else module(k, parts, g) for _, parts in segments]
    bounds = [0]
    for count, _ in segments:
        bounds.append(bounds[-1] + count)
    rows = bounds[-1]
    descs, keep = [], []
    for m in modules:
        if m is None:
            descs.append(0)
            continue
        desc, tensors = cpu_kernels.pack_lora_module(*m)
        keep += [desc, *tensors]
        descs.append(desc.data_ptr())
    table = torch.tensor(descs, dtype=torch.int64)
    x = torch.randn(rows, k, generator=g).to(BF16)
    y = torch.randn(rows, n, generator=g).to(BF16)
    want = reference(x, y, bounds, modules)
    scratch = torch.empty(rows, 128, dtype=BF16)
    kernels.lora(
        x, y, torch.tensor(bounds, dtype=torch.int32), table.data_ptr(), len(modules), scratch
    )
    # Same rounding points as torch; only the order of each sum differs.
    torch.testing.assert_close(y.float(), want.float(), atol=0.05, rtol=0.02)
    for s, m in enumerate(modules):  # the base model's rows are not touched
        if m is None:
            assert torch.equal(y[bounds[s] : bounds[s + 1]], want[bounds[s] : bounds[s + 1]])


def test_the_gated_matmul_answers_the_projection_itself_for_lora():
    kernels = kernels_or_skip(False)
    if not kernels.has_linear:
        pytest.skip("the matmul is in the AVX512-BF16 build only")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(19, 256, generator=g).to(BF16)
    w = torch.randn(2 * 72, 256, generator=g).to(BF16)
    raw = kernels.linear(x, kernels.pack_linear(w, gated=True), None, 72, gated=True, raw=True)
    torch.testing.assert_close(raw.float(), F.linear(x, w).float(), atol=0.05, rtol=0.02)


# --- the native bf16 forward with adapters ---------------------------------------------


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora-kernels")
    return model, {
        "a": build_tiny_lora(model, root / "a", seed=1, rank=8),
        "b": build_tiny_lora(model, root / "b", seed=2, rank=3, targets="mlp"),
    }


def peft_logits(model_dir, adapter, dtype, prompt) -> torch.Tensor:
    """The last position's logits of transformers + PEFT, the adapter applied beside the
    base weights (not merged into them), as PEFT serves it."""
    model = reference_model(model_dir, dtype)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, torch_dtype=dtype)
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


@pytest.mark.parametrize("kernel_matmul", [False, True], ids=["onednn", "kernels-matmul"])
def test_native_bf16_lora_is_as_close_to_fp32_as_peft_bf16(adapters, kernel_matmul, monkeypatch):
    kernels = kernels_or_skip(False)
    if kernel_matmul and not kernels.has_linear:
        pytest.skip("the matmul is in the AVX512-BF16 build only")
    # The kernels' own matmul fuses SiLU into gate/up; with LoRA on gate/up it must give
    # the projection first (the raw mode). oneDNN's path adds between its two ops.
    monkeypatch.setattr(kernels, "prefer_linear", kernel_matmul)
    model, paths = adapters
    modules = [LoraModule(n, str(p)) for n, p in paths.items()]
    lora = LoraConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2, modules=modules)
    llm = LLM(
        str(model), kv_cache_memory_bytes=SMALL_KV, model_impl="native", dtype="bfloat16", lora=lora
    )
    assert llm.engine.runner.backend.layers[0].gate_up.fused == kernel_matmul
    prompts = make_prompts((7, 12, 5, 9))
    names = ["a", None, "b", "a"]
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        request = EngineCoreRequest(
            f"r{i}", prompt, SamplingParams(max_tokens=1), 0.0, lora_name=name
        )
        assert llm.engine.add_request(request) == []
    plan = llm.engine.scheduler.schedule()
    ids, positions, meta, rows = llm.engine.runner.prepare(plan)
    assert isinstance(meta.lora, LoraRows) and meta.lora.kernels is kernels
    got = llm.engine.runner.backend.forward(ids, positions, meta, rows)
    # Over every row (bf16 noise differs row by row: the rounding points of unmerged
    # LoRA are PEFT's own, not the same ones per element).
    ours, peft_bf16 = [], []
    for row, request in enumerate(plan.sampling):
        i = int(request.request_id[1:])
        adapter = paths.get(names[i])
        truth = peft_logits(model, adapter, torch.float32, prompts[i])
        ours.append((got[row] - truth).abs())
        peft_bf16.append((peft_logits(model, adapter, torch.bfloat16, prompts[i]) - truth).abs())
    ours, peft_bf16 = torch.stack(ours), torch.stack(peft_bf16)
    assert ours.max() <= 1.5 * peft_bf16.max(), (ours.max(), peft_bf16.max())
    assert ours.mean() <= 1.25 * peft_bf16.mean(), (ours.mean(), peft_bf16.mean())
