"""The engine's LoRA adapters: which names are registered, which are loaded in memory,
which run, and the loads.

Three sets, as vLLM users know them:
- registered: every name a request may use (`--lora-modules`, runtime loads), at most
  MAX_LORA_ADAPTERS;
- loaded: adapters whose weights are in memory, packed for the backend, an LRU of
  `--max-cpu-loras` (an evicted one is read again from its folder when needed);
- active: adapters with running requests, at most `--max-loras`: a request whose
  adapter is neither active nor can become so waits (the scheduler skips it).

Loads run on a thread of their own (reading, checking and packing a folder never
holds up a step); their results are taken in by `poll()` on the step thread, which
alone changes these sets.
"""

from __future__ import annotations

import logging
import queue
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from engine_core.lora_adapter import LoraError, LoraTargets, LoraWeights, read_adapter
from protocol.messages import MAX_LORA_ADAPTERS, LoraConfig, check_lora_name, check_lora_path

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LoraSpec:
    """One registered adapter. Requests hold their spec, so an unload (or a reload under
    the same name) never changes the adapter of a request already queued."""

    name: str
    path: str
    base_model_name: str | None
    digest: bytes = b""  # its files' digest: the seed of its prefix-cache hashes
    adapter: object | None = None  # the backend's packed form, while loaded
    running: int = 0  # running requests
    loading: bool = False
    error: str | None = None  # its last load failed (it could not be read again)
    waiters: list[Future] = field(default_factory=list)  # runtime loads to answer


class LoraManager:
    def __init__(
        self,
        config: LoraConfig,
        targets: LoraTargets,
        prepare: Callable[[LoraWeights], object],
    ) -> None:
        if not 1 <= config.max_loras <= config.max_cpu_loras:
            raise ValueError(
                f"LoRA needs 1 <= max_loras ({config.max_loras}) <= max_cpu_loras "
                f"({config.max_cpu_loras})"
            )
        if config.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1; got {config.max_lora_rank}")
        self.config = config
        self.targets = targets
        self.prepare = prepare
        self.registry: dict[str, LoraSpec] = {}
        self.pending: dict[str, LoraSpec] = {}  # runtime loads not yet answered
        self.loaded: OrderedDict[LoraSpec, None] = OrderedDict()  # LRU order, oldest first
        self.num_active = 0
        self.version = 0  # bumped by each change of the registry
        self._done: queue.Queue = queue.Queue()  # the engine waits on it: see process.py
        self._loads = 0  # submitted, not yet taken in
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")

    # --- start-up and runtime registration ---------------------------------------

    def load_startup(self) -> None:
        """Read and check every --lora-modules adapter now (a bad one stops the engine
        with its reason); the first max_cpu_loras stay loaded."""
        for module in self.config.modules:
            spec = self._new_spec(module.name, module.path, module.base_model_name)
            weights = read_adapter(spec.name, spec.path, self.targets, self.config.max_lora_rank)
            spec.digest = weights.digest
            if len(self.loaded) < self.config.max_cpu_loras:
                spec.adapter = self.prepare(weights)
                self.loaded[spec] = None
            self.registry[spec.name] = spec
            logger.info(
                "LoRA adapter %r loaded from %s (rank %d)", spec.name, spec.path, weights.rank
            )
        self.version += 1

    def add(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> Future:
        """Register an adapter at run time: answered (True, or a LoraError) once it is
        read, checked and loaded, off the step thread. `replace` (vLLM's load_inplace)
        swaps an adapter of that name for this one; requests already queued keep theirs."""
        spec = self._new_spec(name, path, base_model_name, replace)
        done: Future = Future()
        spec.waiters.append(done)
        self.pending[name] = spec
        self._submit(spec)
        return done

    def remove(self, name: str) -> bool:
        """Unregister an adapter. Requests already queued with it still finish; its
        weights go now if nothing runs with it (else when the LRU drops them)."""
        spec = self.registry.pop(name, None)
        if spec is None:
            raise LoraError(f"The lora adapter '{name}' cannot be found.")
        self.version += 1
        if spec.running == 0 and spec in self.loaded:
            del self.loaded[spec]
            spec.adapter = None
        logger.info("LoRA adapter %r removed", name)
        return True

    def list(self) -> list[list[str | None]]:
        """[name, base_model_name] of every registered adapter."""
        return [[s.name, s.base_model_name] for s in self.registry.values()]

    def lookup(self, name: str) -> LoraSpec:
        spec = self.registry.get(name)
        if spec is None:
            raise LoraError(f"The model `{name}` does not exist.")
        return spec

    def _new_spec(
        self, name: str, path: str, base_model_name: str | None, replace: bool = False
    ) -> LoraSpec:
        problem = check_lora_name(name) or check_lora_path(path)
        if base_model_name is not None and not isinstance(base_model_name, str):
            problem = "base_model_name must be a string"
        if problem:
            raise LoraError(problem)
        if name in self.registry and not replace:
            raise LoraError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        if name in self.pending:
            raise LoraError(f"The lora adapter '{name}' is being loaded.")
        if (
            name not in self.registry
            and len(self.registry) + len(self.pending) >= MAX_LORA_ADAPTERS
        ):
            raise LoraError(f"this server already holds {MAX_LORA_ADAPTERS} LoRA adapters")
        return LoraSpec(name, path, base_model_name)

    # --- loads ------------------------------------------------------------------------

    def _submit(self, spec: LoraSpec) -> None:
        spec.loading = True
        self._loads += 1
        self._loader.submit(self._load, spec)

    def _load(self, spec: LoraSpec) -> None:
        """Loader thread: read, check, pack; the step thread takes the result in."""
        try:
            weights = read_adapter(spec.name, spec.path, self.targets, self.config.max_lora_rank)
            result: object = (weights.digest, self.prepare(weights))
        except Exception as e:  # a bad adapter must never take the engine down
            result = e if isinstance(e, LoraError) else LoraError(f"{type(e).__name__}: {e}")
        self._done.put((spec, result))

    @property
    def loading(self) -> bool:
        return self._loads > 0

    def poll(self, wait_s: float = 0.0) -> list[LoraSpec]:
        """Take in finished loads (waiting at most `wait_s` for one); answers the
        registered adapters whose reload failed, so their waiting requests can end."""
        failed = []
        while self._loads:
            try:
                spec, result = self._done.get(timeout=wait_s) if wait_s else self._done.get_nowait()
            except queue.Empty:
                break
            wait_s = 0.0
            self._loads -= 1
            spec.loading = False
            if self._take_in(spec, result):
                failed.append(spec)
        return failed

    def _take_in(self, spec: LoraSpec, result: object) -> bool:
        """Apply one load's result; True when a registered adapter failed to reload."""
        runtime = self.pending.pop(spec.name, None) is spec
        if isinstance(result, Exception):
            logger.warning("LoRA adapter %r failed to load: %s", spec.name, result)
            for waiter in spec.waiters:
                waiter.set_exception(result)
            spec.waiters.clear()
            if runtime:
                return False
            spec.error = str(result)
            return True
        digest, adapter = result
        if spec.digest and digest != spec.digest:
            spec.error = f"the files of LoRA adapter {spec.name!r} changed since it was loaded"
            logger.warning("%s", spec.error)
            return True
        spec.digest, spec.adapter, spec.error = digest, adapter, None
        self.loaded[spec] = None
        self._evict()
        if runtime:
            old = self.registry.get(spec.name)
            self.registry[spec.name] = spec
            self.version += 1
            if old is not None and old.running == 0 and old in self.loaded:
                del self.loaded[old]  # replaced in place, and nothing runs with it
                old.adapter = None
            logger.info("LoRA adapter %r loaded from %s", spec.name, spec.path)
        for waiter in spec.waiters:
            waiter.set_result(True)
        spec.waiters.clear()
        return False

    def _evict(self) -> None:
        """Drop the least recently used idle adapters beyond max_cpu_loras."""
        excess = len(self.loaded) - self.config.max_cpu_loras
        for spec in list(self.loaded):
            if excess <= 0:
                return
            if spec.running == 0:
                del self.loaded[spec]
                spec.adapter = None
                excess -= 1

    # --- the scheduler's side -----------------------------------------------------------

    def try_activate(self, spec: LoraSpec) -> bool:
        """Count one more running request of `spec` if it may run now: loaded, and active
        already or a slot free. Otherwise False, and its load starts if it needs one."""
        if spec.adapter is None:
            if not spec.loading and spec.error is None and self._has_room():
                self._submit(spec)
            return False
        if spec.running == 0:
            if self.num_active >= self.config.max_loras:
                return False
            self.num_active += 1
        spec.running += 1
        self.loaded.move_to_end(spec)
        return True

    def release(self, spec: LoraSpec) -> None:
        """One running request of `spec` stopped (finished, preempted or aborted)."""
        spec.running -= 1
        if spec.running == 0:
            self.num_active -= 1
            if spec.name not in self.registry or self.registry[spec.name] is not spec:
                if spec in self.loaded:  # unloaded meanwhile: nothing else needs it
                    del self.loaded[spec]
                    spec.adapter = None

    def _has_room(self) -> bool:
        """Whether one more adapter may be loaded (one in memory is idle, or there is space)."""
        if len(self.loaded) + self._loads < self.config.max_cpu_loras:
            return True
        return any(s.running == 0 for s in self.loaded)

    def loaded_names(self) -> list[str]:
        return [s.name for s in self.loaded if self.registry.get(s.name) is s]

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
