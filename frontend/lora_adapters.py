"""This API server's view of the LoRA adapters, and the runtime loads and unloads.

The engines hold the adapter list: every engine (local and headless) serves the same
adapters, and a runtime load or unload answers only once every engine has done it. An
API server keeps a copy (name → parent) and reads the list again from an engine when a
name is not in it or an engine reports a change (SchedulerStats.lora_version), so a
load through one API server is seen by every other one at its next request.

What a runtime load may name (it is an operator feature, off unless
--enable-runtime-lora-updating, and behind --api-key when that is set): an adapter name
of letters, digits and `._:@+/-` (at most 128 characters, not a served model's name),
and an absolute path of at most 4096 characters; the engines then read only the two
files of a PEFT adapter from that folder (adapter_config.json, at most 1 MiB, and
adapter_model.safetensors, at most what an adapter of the base at --max-lora-rank can
weigh), regular files only, never a pickle.
"""

from __future__ import annotations

import asyncio
import logging
import os

from frontend.config import FrontendConfig
from frontend.engine_client import EngineClient
from frontend.engine_state import EngineState
from frontend.errors import APIError
from protocol.messages import check_lora_name, check_lora_path

log = logging.getLogger("zserve.api")

# How long a runtime load or unload may take on the engines, and a refresh of the list.
LOAD_TIMEOUT_S = 120.0
REFRESH_TIMEOUT_S = 10.0
# An engine error that means the adapter's folder is not there (a 404, as in vLLM).
_NOT_FOUND = "is not a folder on this machine"


class LoraAdapters:
    def __init__(self, config: FrontendConfig, client: EngineClient) -> None:
        self.enabled = config.enable_lora
        self.runtime = config.enable_lora and config.enable_runtime_lora_updating
        self.client = client
        self.base_names = list(config.served_model_names)
        self.parents: dict[str, str] = {
            m.name: m.base_model_name or self.base_names[0] for m in config.lora_modules
        }
        self._versions: dict[int, int] = {}  # engine rank → lora_version at the last read
        self._refreshing: asyncio.Task | None = None
        self._changing = asyncio.Lock()  # one runtime load or unload at a time here

    # --- names ----------------------------------------------------------------------

    async def find(self, name: str) -> bool:
        """Whether `name` is an adapter, reading the list again when it may be stale."""
        if not self.enabled:
            return False
        if self.runtime and (name not in self.parents or self._stale()):
            await self.refresh()
        return name in self.parents

    async def models(self) -> list[tuple[str, str]]:
        """(adapter, parent) of every adapter, for /v1/models."""
        if self.runtime and self._stale():
            await self.refresh()
        return list(self.parents.items())

    def _stale(self) -> bool:
        return any(
            e.alive and e.stats.lora_version != self._versions.get(e.rank)
            for e in self.client.engines
        )

    async def refresh(self) -> None:
        """Read the adapter list from an engine (concurrent callers share one read)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._read_list())
        await asyncio.shield(self._refreshing)

    async def _read_list(self) -> None:
        engine = next((e for e in self.client.engines if e.alive), None)
        if engine is None:
            return
        versions = {e.rank: e.stats.lora_version for e in self.client.engines}
        try:
            listed = await asyncio.wait_for(
                self.client.call_utility(engine, "list_loras"), REFRESH_TIMEOUT_S
            )
        except (asyncio.TimeoutError, RuntimeError) as e:
            log.warning("could not read the LoRA adapters of engine %d: %s", engine.rank, e)
            return
        self.parents = {name: parent or self.base_names[0] for name, parent in listed}
        self._versions = versions

    # --- runtime loads --------------------------------------------------------------

    async def load(self, name: str, path: str, inplace: bool) -> str:
        """Load an adapter on every engine; the success text vLLM answers, or APIError."""
        problem = check_lora_name(name) or check_lora_path(path)
        if problem:
            raise APIError(problem, param="lora_name" if "name" in problem else "lora_path")
        if not os.path.isabs(path):
            raise APIError(
                f"lora_path must be an absolute path on the server; got {path!r}",
                param="lora_path",
            )
        if name in self.base_names:
            raise APIError(f"The lora adapter '{name}' conflicts with a served base model.")
        async with self._changing:
            if await self.find(name) and not inplace:
                raise APIError(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
            done, failures = await self._on_every_engine("add_lora", name, path, None, inplace)
            if failures:
                if not inplace:  # undo it where it went in: no engine serves it alone
                    await self._on_engines(done, "remove_lora", name)
                message = failures[0]
                status = 404 if _NOT_FOUND in message else 400
                raise APIError(message, status, param="lora_path")
            self.parents[name] = self.base_names[0]
        log.info("LoRA adapter %r loaded from %s on every engine", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        if check_lora_name(name):
            raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._changing:
            if not await self.find(name):
                raise APIError(f"The lora adapter '{name}' cannot be found.", 404)
            _, failures = await self._on_every_engine("remove_lora", name)
            failures = [f for f in failures if "cannot be found" not in f]
            if failures:
                raise APIError(f"unloading {name!r} failed on an engine: {failures[0]}", 500)
            self.parents.pop(name, None)
        log.info("LoRA adapter %r unloaded from every engine", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _on_every_engine(self, method: str, *args) -> tuple[list[EngineState], list[str]]:
        """Call `method` on every live engine at once: the engines it worked on, and the
        failures' messages."""
        engines = [e for e in self.client.engines if e.alive]
        if not engines:
            raise APIError("no engine is alive", 503)
        results = await self._on_engines(engines, method, *args)
        done = [e for e, r in zip(engines, results) if not isinstance(r, BaseException)]
        failures = [_message(r) for r in results if isinstance(r, BaseException)]
        return done, failures

    async def _on_engines(self, engines: list[EngineState], method: str, *args) -> list:
        calls = [
            asyncio.wait_for(self.client.call_utility(e, method, *args), LOAD_TIMEOUT_S)
            for e in engines
        ]
        return await asyncio.gather(*calls, return_exceptions=True)


def _message(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return f"no answer from the engine within {LOAD_TIMEOUT_S:.0f} s"
    return str(error)
