"""What the supervisor (or a headless launcher) hands one engine-core process."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.config import EngineConfig
from protocol.sockets import CurveKeys


@dataclass
class EngineProcConfig:
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
