"""The supervisor of `zserve serve`: claims the port, starts the API servers and the
engines, runs the engine handshake, then watches every child until a signal or a
death ends the server. Shutdown order: API servers, then engines."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import zmq

from engine_core.config import EngineProcConfig
from launcher.api_servers import APIServers
from launcher.children import StartupError, check_alive, stop_all
from launcher.engine_handshake import EngineHandshake, engine_plan
from launcher.engine_restarts import EngineRestarts
from launcher.engine_set import EngineSet, LocalEngines
from launcher.http_door import UnixListener, claim_unix_socket, listen_address
from launcher.monitor import monitor
from launcher.plan import LaunchPlan
from launcher.port import PortBusyError, claim_port
from launcher.process_setup import dump_stacks_on_signal, raise_open_files_limit
from launcher.runtime_dir import RuntimeDir, sweep_stale
from protocol.handshake import EnginePlan, ProtocolVersionError
from protocol.keys import EngineKeysError, engine_keys, start_authenticator
from protocol.sockets import CurveKeys

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
        sweep_stale()
        self.runtime = RuntimeDir()
        self.runtime_dir = self.runtime.path
        self.api_servers: APIServers | None = None
        self.engines: EngineSet = LocalEngines()  # or RayEngines (connect_ray)
        self.stop_signal: int | None = None
        self.port_holder = None  # the socket holding the HTTP port (launcher/port.py)
        self.unix_listener: UnixListener | None = None  # --uds (launcher/http_door.py)
        self.handshake: EngineHandshake | None = None
        self.keys = None
        self.auth = None

    def run(self) -> int:
        """The whole life of the server; the exit code: 0 after a signal, 1 after a failure."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        raise_open_files_limit()
        dump_stacks_on_signal()
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
        if frontend.uds:
            self.unix_listener = claim_unix_socket(frontend.uds)
        else:
            self.port_holder = claim_port(frontend.host, frontend.port)
        if self.plan.ray is not None:
            self.connect_ray()
        self.handshake = EngineHandshake(
            self.zmq, self.handshake_address(), self.keys, self.topology
        )
        self.api_servers = APIServers(
            self.plan,
            dataclasses.replace(frontend, curve=self.keys),
            self.runtime_dir,
            self.check,
            listener=self.unix_listener.sock if self.unix_listener else None,
        )
        self.api_servers.start()
        self.start_engines()
        self.handshake.run(self.engine_plan(), self.plan.engine_ready_timeout_s, self.check)
        self.api_servers.wait_serving()
        log.info(
            "zserve ready on %s (%d API server(s), %d engine(s))",
            listen_address(frontend),
            len(self.api_servers.children),
            self.topology.data_parallel_size,
        )
        return monitor(self.api_servers, self.engines, self.engine_restarts())

    def engine_restarts(self) -> EngineRestarts | None:
        """--engine-restart-policy on-failure: what starts a dead engine again."""
        if self.plan.engine_restart_policy != "on-failure":
            return None
        return EngineRestarts(
            self.engines,
            self.handshake,
            self.engine_plan,
            self.start_engine,
            self.plan.engine_ready_timeout_s,
        )

    def connect_ray(self) -> None:
        """Join the Ray cluster and reserve the engines' bundles, before any child
        starts; the API servers bind on this node's Ray address unless
        --data-parallel-address says otherwise."""
        # Each engine's log lines as they are: Ray's driver would fold lines that
        # differ only in numbers (the ranks) into one "[repeated Nx]".
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        from launcher.ray_engines import RayEngines

        self.engines = engines = RayEngines(self.plan.ray)
        ip = engines.connect()
        # ray.init may install handlers of its own; the supervisor's come first.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.topology.head_address is None:
            self.topology = dataclasses.replace(self.topology, head_address=ip)
            self.plan = dataclasses.replace(self.plan, topology=self.topology)
        engines.place()

    def engine_plan(self) -> EnginePlan:
        return engine_plan(*self.api_servers.endpoints(), self.plan.engine.lora)

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
        if self.plan.ray is not None and self.plan.engine_keys_dir is None:
            # Fresh for this server, in memory only: they reach the actors through Ray.
            self.keys = CurveKeys(*zmq.curve_keypair())
            self.auth = start_authenticator(self.zmq, self.keys)
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
        ranks = (
            range(self.topology.data_parallel_size) if self.plan.ray else self.topology.local_ranks
        )
        for rank in ranks:
            self.start_engine(rank, 0)

    def start_engine(self, rank: int, incarnation: int) -> None:
        """Start rank `rank` here (a process) or on the Ray cluster (an actor)."""
        on_ray = self.plan.ray is not None
        index = rank - self.topology.start_rank
        cfg = EngineProcConfig(
            engine=dataclasses.replace(
                self.plan.engine, data_parallel_rank=rank, data_parallel_local_rank=index
            ),
            rank=rank,
            handshake_address=self.handshake.address
            if self.handshake
            else self.handshake_address(),
            local=not (self.topology.headless or on_ray),
            headless=self.topology.headless or on_ray,  # Ray's engines join as remote ones do
            ready_timeout_s=self.plan.engine_ready_timeout_s,
            log_level=self.plan.log_level,
            parent_pid=None if on_ray else os.getpid(),
            curve=self.keys,
            cpus=None if on_ray else self.plan.engine_cpus[index],
            incarnation=incarnation,
        )
        self.engines.start(cfg)

    def check(self) -> None:
        """While starting (or restarting an API server): any child's exit ends it."""
        check_alive(self.api_servers.children if self.api_servers else [], starting=True)
        self.engines.check_alive()

    def shutdown(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.api_servers is not None:
            drain = self.plan.frontend.shutdown_timeout if self.stop_signal is not None else 0.0
            stop_all([c.process for c in self.api_servers.children], grace_s=drain + STOP_GRACE_S)
        self.engines.stop_all(grace_s=STOP_GRACE_S)
        if self.api_servers is not None:
            self.api_servers.close_pipes()
        if self.handshake is not None:
            self.handshake.close()
        if self.auth is not None:
            self.auth.stop()
        self.zmq.destroy(linger=0)
        if self.port_holder is not None:
            self.port_holder.close()
        if self.unix_listener is not None:
            self.unix_listener.release()
        self.runtime.close()


class _Stop(Exception):
    """Raised from the signal handler to unwind whatever the supervisor is waiting on."""
