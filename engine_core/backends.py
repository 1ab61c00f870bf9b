"""The model backends by --model-impl name, and the one an engine's config asks for.

A backend class provides `unsupported_reason(info)`, `build(config, info, dtype,
device, max_model_len)` and its `architectures`, then the ModelBackend interface
(model_backend.py). "auto" takes the first, in this order, that supports the model.
"""

from __future__ import annotations

import torch

from engine_core.config import EngineConfig
from engine_core.hf_backend import TransformersBackend
from engine_core.model_backend import ModelBackend
from engine_core.model_loader import ModelInfo
from engine_core.native_llama import NativeLlamaBackend

BACKENDS = {"native": NativeLlamaBackend, "transformers": TransformersBackend}


def make_backend(
    config: EngineConfig,
    info: ModelInfo,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> ModelBackend:
    """The backend `config.model_impl` names, or for auto the first that fits the model."""
    impl = config.model_impl
    if config.cpu_kernels not in ("auto", "off"):
        raise ValueError(f"cpu_kernels must be auto or off; got {config.cpu_kernels!r}")
    if impl != "auto" and impl not in BACKENDS:
        names = ["auto", *BACKENDS]
        raise ValueError(f"model_impl must be {', '.join(names[:-1])} or {names[-1]}; got {impl!r}")
    for name, backend in BACKENDS.items():
        if impl not in ("auto", name):
            continue
        reason = backend.unsupported_reason(info)
        if reason is None:
            return backend.build(config, info, dtype, device, max_model_len)
        if impl == name:
            raise ValueError(
                f"model_impl={name!r} is not available for this model ({reason}); {name} "
                f"architectures: {', '.join(backend.architectures)}"
            )
    raise ValueError(f"no model backend supports {info.architecture}")
