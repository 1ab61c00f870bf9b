"""Which device each local engine takes (engine_core.device.spread_over_gpus)."""

from __future__ import annotations

import pytest

from engine_core.device import select_device, spread_over_gpus


@pytest.mark.parametrize(
    ("requested", "local_rank", "gpus", "expected"),
    [
        ("cuda", 0, 4, "cuda:0"),
        ("cuda", 3, 4, "cuda:3"),  # a GPU of its own per local engine
        ("auto", 2, 4, "cuda:2"),
        ("cuda", 5, 4, "cuda:1"),  # more engines than GPUs: they share, in turn
        ("cuda", 1, 1, "cuda:0"),
        ("cuda:2", 0, 4, "cuda:2"),  # an explicit index is the user's choice
        ("cuda:2", 3, 4, "cuda:2"),
        ("cpu", 1, 4, "cpu"),
        ("auto", 1, 0, "cpu"),  # no GPU: auto is the CPU
        ("cuda", 0, 0, "cuda"),  # no GPU: left for select_device to refuse clearly
    ],
)
def test_each_local_engine_takes_its_own_gpu(requested, local_rank, gpus, expected):
    assert spread_over_gpus(requested, local_rank, gpus) == expected


def test_a_cuda_engine_without_a_gpu_is_refused_clearly():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(ValueError, match="no CUDA device is available"):
        select_device("cuda", local_rank=1)
    assert select_device("auto", local_rank=1).type == "cpu"
