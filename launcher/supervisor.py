"""The supervisor of `zserve serve`: claims the port, starts the API servers and the
engines, runs the engine handshake, then watches every child until a signal or a
death ends the server. Shutdown order: API servers, then engines."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import tempfile

import zmq

from engine_core.config import EngineProcConfig
from launcher.api_servers import APIServers
from launcher.children import Child, StartupError, check_alive, spawn_engine, stop_all
from launcher.engine_handshake import EngineHandshake, engine_plan
from launcher.monitor import monitor
from launcher.plan import LaunchPlan
from launcher.port import PortBusyError, claim_port
from launcher.process_setup import raise_open_files_limit
from protocol.handshake import ProtocolVersionError
from protocol.keys import EngineKeysError, engine_keys, start_authenticator

log = logging.getLogger("zserve.supervisor")

# SIGTERM to an engine, then this long before SIGKILL (an API server gets the drain too).
STOP_GRACE_S = 10.0


class Supervisor:
    """One node's server for its life: the head (API servers and engines, or only API
    servers when every engine is remote) or a headless worker (engines only)."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.topology = plan.topology
        self.zmq = zmq.Context()
        self.runtime_dir = tempfile.mkdtemp(prefix=f"zserve-{os.getpid()}-")
        self.api_servers: APIServers | None = None
        self.engines: list[Child] = []
        self.stop_signal: int | None = None
        self.port_holder = None  # the socket holding the HTTP port (launcher/port.py)
        self.handshake: EngineHandshake | None = None
        self.keys = None
        self.auth = None

    def run(self) -> int:
        """The whole life of the server; the exit code: 0 after a signal, 1 after a failure."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        raise_open_files_limit()
        try:
            self.load_keys()
            if self.topology.headless:
                return self.run_headless()
            return self.run_head()
        except (PortBusyError, EngineKeysError) as e:
            log.error("%s", e)
            return 1
        except (StartupError, ProtocolVersionError, TimeoutError) as e:
            log.error("start-up failed: %s", e)
            return 1
        except _Stop:
            return 0
        finally:
            self.shutdown()

    def run_head(self) -> int:
        frontend = self.plan.frontend
        self.port_holder = claim_port(frontend.host, frontend.port)
        self.handshake = EngineHandshake(
            self.zmq, self.handshake_address(), self.keys, self.topology
        )
        self.api_servers = APIServers(
            self.plan, dataclasses.replace(frontend, curve=self.keys), self.runtime_dir, self.check
        )
        self.api_servers.start()
        self.start_engines()
        self.handshake.run(
            engine_plan(*self.api_servers.endpoints(), self.plan.engine.lora),
            self.plan.engine_ready_timeout_s,
            self.check,
        )
        self.api_servers.wait_serving()
        log.info(
            "zserve ready on http://%s:%d (%d API server(s), %d engine(s))",
            frontend.host or "0.0.0.0",
            frontend.port,
            len(self.api_servers.children),
            self.topology.data_parallel_size,
        )
        return monitor(self.api_servers, self.engines)

    def run_headless(self) -> int:
        """Engines only; they join the head at its handshake address."""
        self.start_engines()
        first = self.topology.start_rank
        log.info(
            "headless: %d engine(s) (ranks %d..%d) joining %s",
            self.topology.local_engines,
            first,
            first + self.topology.local_engines - 1,
            self.handshake_address(),
        )
        return monitor(None, self.engines)

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            log.info("%s: shutting down", signal.Signals(signum).name)
            raise _Stop()

    def load_keys(self) -> None:
        """CURVE keys for engine links over TCP: the head creates them if missing and
        authenticates with them; a worker waits for its copy."""
        if self.topology.all_local:
            return
        headless = self.topology.headless
        self.keys = engine_keys(
            self.plan.engine_keys_dir,
            create=not headless,
            wait_s=self.plan.engine_ready_timeout_s if headless else 0.0,
        )
        if not headless:
            self.auth = start_authenticator(self.zmq, self.keys)

    def handshake_address(self) -> str:
        return self.topology.handshake_address(self.runtime_dir)

    def start_engines(self) -> None:
        for i, rank in enumerate(self.topology.local_ranks):
            cfg = EngineProcConfig(
                engine=dataclasses.replace(self.plan.engine, data_parallel_rank=rank),
                rank=rank,
                handshake_address=self.handshake_address(),
                local=not self.topology.headless,
                headless=self.topology.headless,
                ready_timeout_s=self.plan.engine_ready_timeout_s,
                log_level=self.plan.log_level,
                parent_pid=os.getpid(),
                curve=self.keys,
                cpus=self.plan.engine_cpus[i],
            )
            self.engines.append(spawn_engine(cfg))

    def check(self) -> None:
        """While starting (or restarting an API server): any child's exit ends it."""
        api = self.api_servers.children if self.api_servers else []
        check_alive(api + self.engines, starting=True)

    def shutdown(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.api_servers is not None:
            drain = self.plan.frontend.shutdown_timeout if self.stop_signal is not None else 0.0
            stop_all([c.process for c in self.api_servers.children], grace_s=drain + STOP_GRACE_S)
        stop_all([c.process for c in self.engines], grace_s=STOP_GRACE_S)
        if self.api_servers is not None:
            self.api_servers.close_pipes()
        if self.handshake is not None:
            self.handshake.close()
        if self.auth is not None:
            self.auth.stop()
        self.zmq.destroy(linger=0)
        if self.port_holder is not None:
            self.port_holder.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


class _Stop(Exception):
    """Raised from the signal handler to unwind whatever the supervisor is waiting on."""
