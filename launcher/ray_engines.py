"""--data-parallel-backend ray: the engines as actors of a running Ray cluster.

The supervisor connects to the cluster as a Ray driver, reserves one placement-group
bundle per engine (ray_placement.py), and starts each rank as an EngineActor
(ray_actor.py) in its bundle. The API servers stay beside the supervisor; the
engines join them over TCP with CURVE, exactly as headless engines do.

An actor's `run` returns when its engine ends; a watcher thread waits on those
results and turns each into an EngineExit (an actor or node that died is one too),
waking the supervisor's monitor through a socket pair. The placement group and the
actors belong to this driver: when the supervisor exits, even by SIGKILL, Ray
removes them.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher.children import StartupError
from launcher.engine_set import EngineExit
from launcher.ray_actor import EngineActor
from launcher.ray_placement import (
    RayPlan,
    bundle_selectors,
    describe_bundle,
    describe_nodes,
    engine_bundle,
    shortfall,
)

if TYPE_CHECKING:
    from engine_core.config import EngineProcConfig

log = logging.getLogger("zserve.supervisor")

CONNECT_CHECK_S = 5.0  # a TCP connect to the cluster's address, before Ray's own retries


class RayEngines:
    def __init__(self, plan: RayPlan) -> None:
        self.plan = plan
        self.head_node_id = ""
        self.bundle: dict[str, float] = {}
        self.group = None
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.runs: dict[ray.ObjectRef, tuple[int, int]] = {}  # → (rank, incarnation)
        self.lock = threading.Lock()
        self.exited: queue.SimpleQueue[EngineExit] = queue.SimpleQueue()
        self.wake_read, self.wake_write = socket.socketpair()
        self.wake_read.setblocking(False)
        self.closing = threading.Event()
        self.watcher: threading.Thread | None = None

    # --- start-up -----------------------------------------------------------------

    def connect(self) -> str:
        """Join the cluster as a driver; this node's IP address (the default address
        the API servers bind for the engines)."""
        address = self.plan.address
        _check_reachable(address)
        try:
            ray.init(
                address=address,
                namespace="zserve",
                logging_level=logging.WARNING,
                log_to_driver=True,  # the engines' log lines appear in the supervisor's output
            )
        except Exception as e:  # Ray's own: a wrong address, another Ray version
            raise StartupError(f"cannot join the Ray cluster at {address}: {e}") from e
        self.head_node_id = ray.get_runtime_context().get_node_id()
        ip = ray.util.get_node_ip_address()
        log.info(
            "Ray: connected to the cluster at %s from node %s (%s)",
            address,
            self.head_node_id,
            ip,
        )
        self.watcher = threading.Thread(target=self._watch, name="ray-watch", daemon=True)
        self.watcher.start()
        return ip

    def place(self) -> None:
        """Reserve a bundle per engine, or fail with what could not be placed."""
        plan = self.plan
        self.bundle = engine_bundle(plan, ray.cluster_resources().get("GPU", 0.0))
        problem = shortfall(self.bundle, plan.engines, ray.nodes(), plan, self.head_node_id)
        if problem:
            raise StartupError(f"cannot place the engines on the Ray cluster: {problem}")
        self.group = placement_group(
            [dict(self.bundle) for _ in range(plan.engines)],
            strategy=plan.strategy,
            name=f"zserve-{socket.gethostname()}-{os.getpid()}",
            bundle_label_selector=bundle_selectors(plan, self.head_node_id) or None,
        )
        try:
            ray.get(self.group.ready(), timeout=plan.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise StartupError(
                f"Ray did not place {plan.engines} engine bundle(s) of "
                f"{describe_bundle(self.bundle)} (strategy {plan.strategy}) within "
                f"{plan.placement_timeout_s:.0f} s (--ray-placement-timeout): other jobs may "
                f"hold the resources; the alive nodes: "
                f"{describe_nodes([n for n in ray.nodes() if n.get('Alive')])}"
            ) from None
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        for rank in range(plan.engines):
            log.info("engine %d: bundle %s on Ray node %s", rank, self.bundle, nodes.get(rank))

    # --- EngineSet ----------------------------------------------------------------

    def start(self, cfg: EngineProcConfig) -> None:
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        actor = EngineActor.options(
            name=None,
            num_cpus=self.bundle["CPU"],
            num_gpus=self.bundle.get("GPU", 0),
            resources=extra,
            max_restarts=0,  # the supervisor restarts, with a new incarnation
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=cfg.rank
            ),
        ).remote()
        with self.lock:
            self.actors[cfg.rank] = actor
            self.runs[actor.run.remote(cfg)] = (cfg.rank, cfg.incarnation)

    def waitables(self) -> list[object]:
        return [self.wake_read]

    def exits(self, ready: object) -> list[EngineExit]:
        try:
            while self.wake_read.recv(4096):
                pass
        except BlockingIOError:
            pass
        found = []
        while True:
            try:
                found.append(self.exited.get_nowait())
            except queue.Empty:
                return found

    def check_alive(self) -> None:
        try:
            death = self.exited.get_nowait()
        except queue.Empty:
            return
        raise StartupError(f"{death.reason} during start-up")

    def stop(self, rank: int, dump_stacks: bool = False) -> None:
        # dump_stacks: a Ray actor's stacks are Ray's to show (`ray stack`).
        with self.lock:
            actor = self.actors.pop(rank, None)
            for ref, (r, _) in list(self.runs.items()):
                if r == rank:
                    del self.runs[ref]  # a deliberate end, not an exit to report
        if actor is not None:
            ray.kill(actor)

    def stop_all(self, grace_s: float) -> None:
        """Ask every engine to end, wait up to grace_s, kill what is left; then give
        the bundles back and leave the cluster."""
        self.closing.set()
        with self.lock:
            actors, refs = list(self.actors.values()), list(self.runs)
            self.actors.clear()
            self.runs.clear()
        try:
            if actors and ray.is_initialized():
                for actor in actors:
                    actor.stop.remote()
                if refs:
                    ray.wait(refs, num_returns=len(refs), timeout=grace_s)
                for actor in actors:
                    ray.kill(actor)
            if self.group is not None:
                remove_placement_group(self.group)
        finally:
            if self.watcher is not None:
                self.watcher.join(5)
            ray.shutdown()
            self.wake_read.close()
            self.wake_write.close()

    # --- the watcher thread -------------------------------------------------------

    def _watch(self) -> None:
        while not self.closing.is_set():
            with self.lock:
                refs = list(self.runs)
            if not refs:
                self.closing.wait(0.2)
                continue
            done, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            for ref in done:
                with self.lock:
                    owner = self.runs.pop(ref, None)
                if owner is None:
                    continue  # stopped on purpose meanwhile
                rank, incarnation = owner
                self.exited.put(EngineExit(rank, incarnation, _exit_reason(ref, rank)))
                self.wake_write.send(b"!")


def _exit_reason(ref: ray.ObjectRef, rank: int) -> str:
    try:
        code = ray.get(ref, timeout=10)
    except ray.exceptions.RayActorError as e:
        return f"engine {rank}'s Ray actor died: {_why(str(e))}"
    except ray.exceptions.RayError as e:
        return f"engine {rank}'s Ray actor failed: {str(e).splitlines()[0]}"
    return f"engine {rank} (a Ray actor) exited with code {code}"


def _why(message: str) -> str:
    """The sentence of Ray's ActorDiedError that says why (its node died, its worker
    process died, it was killed), with the actor's pid and address lines."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    facts = [line for line in lines if line.startswith(("pid:", "ip:"))]
    cause = next((line for line in lines if "because" in line), lines[0] if lines else "")
    cause = cause.split(". ")[0].rstrip(".")
    return ", ".join([cause, *facts])


def _check_reachable(address: str) -> None:
    """A clear error for a cluster that is not there: Ray itself retries for minutes."""
    target = address.removeprefix("ray://")
    if target == "auto" or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_CHECK_S).close()
    except (OSError, ValueError) as e:
        raise StartupError(
            f"no Ray cluster answers at {address} ({e}); start one (`ray start --head`) or "
            f"point --ray-address / RAY_ADDRESS at its GCS address HOST:PORT"
        ) from None
