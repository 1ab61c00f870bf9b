"""This node's API-server processes: started together, each reporting the endpoints it
bound and then that it serves; one that dies is restarted in its own place."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable

from frontend.admission import Admission
from frontend.config import APIServerConfig, FrontendConfig
from frontend.control import EndpointsBound, EngineDead, Serving
from launcher.children import Child, StartupError, describe, receive, spawn_api_server
from launcher.plan import LaunchPlan

log = logging.getLogger("zserve.supervisor")

MAX_RESTARTS_PER_MINUTE = 5
# Binding two ZMQ sockets takes well under a second; this is for a loaded machine.
ENDPOINTS_TIMEOUT_S = 120


class APIServers:
    def __init__(
        self,
        plan: LaunchPlan,
        frontend: FrontendConfig,
        runtime_dir: str,
        check: Callable[[], None],
        listener: socket.socket | None = None,
    ) -> None:
        self.plan = plan
        self.listener = listener  # --uds: the socket every API server accepts on
        self.frontend = frontend
        self.runtime_dir = runtime_dir
        self.check = check  # raises if any child of the server died (see Supervisor)
        self.children: list[Child] = []
        self.restarts: list[float] = []

    def start(self) -> None:
        """Spawn every API server and learn the endpoints each bound."""
        topology = self.plan.topology
        # prometheus_client's multiprocess mode reads this when the children import it.
        metrics_dir = os.path.join(self.runtime_dir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        admission_path = os.path.join(self.runtime_dir, "admission")
        Admission.create_file(admission_path, topology.api_server_count)
        for index in range(topology.api_server_count):
            cfg = APIServerConfig(
                frontend=self.frontend,
                client_index=index,
                input_address=topology.data_address(self.runtime_dir, f"api{index}-in"),
                output_address=topology.data_address(self.runtime_dir, f"api{index}-out"),
                parent_pid=os.getpid(),
                admission_path=admission_path,
                cpus=self.plan.api_server_cpus,
                listener=self.listener,
            )
            self.children.append(spawn_api_server(cfg))
        for child in self.children:
            bound = receive(child, EndpointsBound, ENDPOINTS_TIMEOUT_S, self.check)
            # A restarted API server binds exactly these endpoints again.
            child.config = dataclasses.replace(
                child.config,
                input_address=bound.input_address,
                output_address=bound.output_address,
            )
            if not topology.all_local:  # ports for the firewall between the nodes
                log.info(
                    "%s binds %s (requests to engines) and %s (engine outputs)",
                    child.name,
                    bound.input_address,
                    bound.output_address,
                )

    def endpoints(self) -> tuple[list[str], list[str]]:
        """Every API server's input and output endpoints, in index order."""
        configs = [c.config for c in self.children]
        return [c.input_address for c in configs], [c.output_address for c in configs]

    def wait_serving(self) -> None:
        for child in self.children:
            receive(child, Serving, self.plan.engine_ready_timeout_s, self.check)

    def restart(self, child: Child) -> None:
        """The same index, port and endpoints; too many deaths in a minute end the server."""
        child.process.join(0)
        index = self.children.index(child)
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 60] + [now]
        log.error(
            "%s (pid %d) died with exit code %s; restarting it (same port, index, endpoints)",
            child.name,
            child.process.pid,
            describe(child.process.exitcode),
        )
        if len(self.restarts) > MAX_RESTARTS_PER_MINUTE:
            raise StartupError(
                f"API servers died {len(self.restarts)} times in a minute; giving up"
            )
        if child.pipe is not None:
            child.pipe.close()
        cfg = dataclasses.replace(child.config, restarts=child.config.restarts + 1)
        new = spawn_api_server(cfg)
        self.children[index] = new
        receive(new, EndpointsBound, ENDPOINTS_TIMEOUT_S, self.check)
        receive(new, Serving, self.plan.engine_ready_timeout_s, self.check)
        log.info("%s is back (pid %d)", new.name, new.process.pid)

    def tell_engine_dead(self, rank: int, reason: str, incarnation: int = -1) -> None:
        """So each API server ends that engine's requests with errors and /health 503."""
        for child in self.children:
            if child.pipe is not None:
                try:
                    child.pipe.send(EngineDead(rank, reason, incarnation))
                except OSError:
                    pass

    def close_pipes(self) -> None:
        for child in self.children:
            if child.pipe is not None:
                child.pipe.close()
