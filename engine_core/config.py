"""The engine core's configuration: parsed once by the launcher, passed down as is."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import LoraConfig
from protocol.sockets import CurveKeys


@dataclass(frozen=True)
class ProfilerConfig:
    """--profiler-config: torch's profiler in every engine, started and stopped by
    POST /start_profile and /stop_profile (vLLM's field names)."""

    torch_profiler_dir: str  # absolute; one trace per engine and start/stop cycle
    profiler: str = "torch"
    torch_profiler_with_stack: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True


@dataclass
class GrammarConfig:
    """Structured outputs in one engine (`--structured-outputs-config`, vLLM's keys
    where vLLM has them)."""

    backend: str = "xgrammar"  # the only one: "auto" means it too
    disable_any_whitespace: bool = False  # a server-wide default for every request
    compile_threads: int = 1  # grammars compile on these, never on the step thread
    compile_timeout_s: float = 30.0  # a request whose grammar takes longer fails
    cache_size: int = 256  # compiled grammars kept (LRU), keyed by constraint
    max_spec_bytes: int = 64 * 1024  # a constraint's text (schema, regex, grammar...)


@dataclass(frozen=True)
class ClassifierConfig:
    """--runner pooling on a sequence-classification model (vLLM's classify task): a
    linear head over the pooled hidden state, then an activation (pooler.py)."""

    num_labels: int
    activation: str = "softmax"  # softmax | sigmoid | identity, when use_activation
    # An LLM used as a classifier (vLLM's classifier_from_token): the head's rows are
    # these tokens' LM-head rows; with two_way (from_2_way_softmax), one row, the
    # second's less the first's. Empty: the checkpoint's score.weight (and score.bias).
    from_tokens: tuple[str, ...] = ()
    two_way: bool = False


@dataclass
class EngineConfig:
    """What one EngineCore needs, in an engine-core process or in-process (LLM)."""

    model: str  # a local folder holding config.json, *.safetensors and the tokenizer
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: by device (default_max_num_seqs)
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the budget
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU; on a GPU, by utilization
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    seed: int = 0
    cpu_threads: int | None = None  # None: usable cores // local engines (cpu_thread_count)
    # The engine shares its cores with a local API server: while the API server has
    # many streams to serve, steps leave it one of the engine's threads' cores
    # (model_runner.threads_for).
    spare_core_for_frontend: bool = False
    model_impl: str = "auto"  # auto | native | transformers (backends.py)
    cpu_kernels: str = "auto"  # auto: the native bf16 forward on CPU uses them | off
    max_logprobs: int = 20  # -1: the whole vocabulary
    # What logprobs hold (vLLM's --logprobs-mode): raw_ or processed_ (after penalties,
    # bias, temperature, min_p, top_k, top_p), logprobs or the logits themselves.
    logprobs_mode: str = "raw_logprobs"
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
    data_parallel_local_rank: int = 0  # this engine's index among its node's engines
    profiler: ProfilerConfig | None = None  # None: no profiler routes (--profiler-config)
    tokenizer: str | None = None  # the grammar compiler's vocabulary (None: `model`'s)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    lora: LoraConfig | None = None  # --enable-lora's settings (None: LoRA off)
    hf_overrides: dict = field(default_factory=dict)  # --hf-overrides: over config.json
    # --runner pooling: every request is pooled into one vector (pooler.py) with this
    # pooler: LAST (the last prompt token's hidden state), MEAN or CLS (the first's).
    runner: str = "generate"  # generate | pooling
    pooling_type: str = "LAST"
    classifier: ClassifierConfig | None = None  # None: pooled vectors are embeddings


@dataclass
class EngineProcConfig:
    """What the supervisor (or a headless launcher) hands one engine-core process."""

    engine: EngineConfig
    rank: int
    handshake_address: str
    local: bool = True
    headless: bool = False
    ready_timeout_s: float = 600.0
    curve: CurveKeys | None = None
    log_level: str = "INFO"
    parent_pid: int | None = None
    cpus: list[int] | None = None  # CPU affinity (--engine-cpus)
    incarnation: int = 0  # 0 at start-up, +1 at each restart of this rank
    node_id: str = ""  # the Ray node it runs on, reported in READY (Ray backend only)


def default_max_num_seqs(device_type: str) -> int:
    """vLLM's server defaults: 128 running sequences on the CPU, 256 on a GPU (that of
    GPUs under 70 GiB; vLLM gives the larger ones 1024 with 8192-token steps). On the CPU
    the smaller batch keeps a burst of new prompts from stalling every running stream
    for long (BENCHMARKS.md §1, seventeenth session)."""
    return 128 if device_type == "cpu" else 256


def cpu_thread_count(cpu_threads: int | None, cores: int, local_engines: int) -> int:
    """CPU threads per engine (its CPU kernels' pool, or torch's where those do not run
    the forward): `cpu_threads` if given, else the cores left to the engines shared
    by the local engines, at least one, so two engines never oversubscribe.

    The launcher leaves the engines the usable cores less one per local API server
    after the first (launcher/plan.py: engine_threads; BENCHMARKS.md §2 has
    the measurements behind it); an engine run in-process takes every usable core.
    """
    if cpu_threads is not None:
        if cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {cpu_threads}")
        return cpu_threads
    return max(1, cores // max(1, local_engines))
