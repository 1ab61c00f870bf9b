"""The engine core's configuration: parsed once by the launcher, passed down as is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str  # a local folder holding config.json, *.safetensors and the tokenizer
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the budget
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # CPU: None → a default of 1 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    seed: int = 0
    cpu_threads: int | None = None  # None: usable cores // local engines
    model_impl: str = "auto"  # auto | native | transformers
    cpu_kernels: str = "auto"  # auto: the native bf16 forward on CPU uses them | off
    max_logprobs: int = 20  # -1: the whole vocabulary
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
