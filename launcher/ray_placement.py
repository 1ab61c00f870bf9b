"""Where the engines of `--data-parallel-backend ray` go: one placement-group bundle per
engine, and the clear refusal when the cluster cannot hold them. Pure functions of the
plan and of what Ray reports about its nodes: no Ray import here.

- Each bundle asks for `--cpu-threads` CPUs (default 1; the engine runs that many
  threads), one GPU when the engines run on GPUs (`--device cuda`, or `auto` on a
  cluster that has GPUs), and the `--ray-engine-resources` hints, e.g.
  '{"zserve_engine": 1}' to place engines only on nodes started with that custom
  resource (`ray start --resources '{"zserve_engine": 4}'`).
- `--data-parallel-size-local K`: ranks 0..K-1 go on the supervisor's own Ray node
  and the others on any other node (a label selector on `ray.io/node-id` per bundle);
  without it, every engine may go anywhere the strategy puts it
  (`--ray-placement-strategy`, SPREAD by default: over as many nodes as it can).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class RayPlan:
    """The Ray half of a launch plan (--data-parallel-backend ray)."""

    address: str  # the cluster's GCS address, or "auto"
    engines: int  # the data-parallel size
    engines_on_head: int | None  # -dpl: ranks pinned to the supervisor's node
    cpus_per_engine: int
    device: str  # --device: decides whether a bundle asks for a GPU
    resources: dict[str, float] = field(default_factory=dict)  # --ray-engine-resources
    strategy: str = "SPREAD"
    placement_timeout_s: float = 60.0


def engine_bundle(plan: RayPlan, cluster_gpus: float) -> dict[str, float]:
    """What one engine reserves."""
    bundle = {"CPU": float(plan.cpus_per_engine), **plan.resources}
    device = plan.device
    if device.startswith("cuda") or (device == "auto" and cluster_gpus >= 1):
        bundle["GPU"] = 1.0
    return bundle


def bundle_selectors(plan: RayPlan, head_node_id: str) -> list[dict[str, str]]:
    """Per bundle (= rank): on the supervisor's node, off it, or anywhere."""
    if plan.engines_on_head is None:
        return []
    return [
        {NODE_ID_LABEL: head_node_id if rank < plan.engines_on_head else f"!{head_node_id}"}
        for rank in range(plan.engines)
    ]


def shortfall(
    bundle: dict[str, float], count: int, nodes: list[dict], plan: RayPlan, head_node_id: str
) -> str | None:
    """Why `count` bundles can never fit on these alive nodes (Ray's `ray.nodes()`
    entries), counting each node's whole resources; None if they might."""
    alive = [n for n in nodes if n.get("Alive")]
    fits = [n for n in alive if _holds(n["Resources"], bundle)]
    on_head = [n for n in fits if n["NodeID"] == head_node_id]
    off_head = [n for n in fits if n["NodeID"] != head_node_id]
    if plan.engines_on_head is None:
        places = {"on any node": (count, fits)}
    else:
        places = {
            "on the supervisor's node": (plan.engines_on_head, on_head),
            "on the other nodes": (count - plan.engines_on_head, off_head),
        }
    for where, (wanted, candidates) in places.items():
        copies = [_copies(n["Resources"], bundle) for n in candidates]
        room = sum(copies)
        if plan.strategy == "STRICT_SPREAD":
            room = min(room, len(candidates))
        elif plan.strategy == "STRICT_PACK":
            room = max(copies, default=0)
        if wanted > room:
            return (
                f"{wanted} engine(s) need {wanted} placement-group bundle(s) of "
                f"{describe_bundle(bundle)} {where}, and the Ray cluster has room for {room} "
                f"(strategy {plan.strategy}); its alive nodes: {describe_nodes(alive)}"
            )
    return None


def describe_bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"


def describe_nodes(nodes: list[dict]) -> str:
    if not nodes:
        return "none"
    return "; ".join(
        f"{n['NodeID'][:8]} at {n.get('NodeManagerAddress', '?')} "
        f"{describe_bundle(_visible(n['Resources']))}"
        for n in nodes
    )


def _visible(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources less Ray's bookkeeping ones (node:IP, memory, object store)."""
    hidden = ("node:", "memory", "object_store_memory")
    return {k: v for k, v in resources.items() if not k.startswith(hidden)}


def _holds(resources: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(resources.get(k, 0.0) >= v for k, v in bundle.items())


def _copies(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles one node's resources hold."""
    return int(min(resources.get(k, 0.0) / v for k, v in bundle.items() if v > 0))
