"""Where Ray's engines go: one bundle per engine, -dpl as node-id label selectors, and
the start-up refusal that names what the cluster cannot hold (launcher/ray_placement.py)."""

from __future__ import annotations

from launcher.ray_placement import (
    RayPlan,
    bundle_selectors,
    describe_bundle,
    engine_bundle,
    shortfall,
)


def ray_plan(**kw) -> RayPlan:
    defaults = dict(address="h:1", engines=2, engines_on_head=None, cpus_per_engine=1)
    return RayPlan(**{**defaults, "device": "auto", **kw})


def node(node_id: str, alive: bool = True, **resources) -> dict:
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": "10.0.0.1",
        "Resources": {"node:10.0.0.1": 1.0, "memory": 1e9, **resources},
    }


def test_a_bundle_holds_the_engines_cpus_its_hints_and_a_gpu_where_engines_use_one():
    assert engine_bundle(ray_plan(cpus_per_engine=4), cluster_gpus=0) == {"CPU": 4.0}
    assert engine_bundle(ray_plan(), cluster_gpus=8) == {"CPU": 1.0, "GPU": 1.0}
    assert engine_bundle(ray_plan(device="cpu"), cluster_gpus=8) == {"CPU": 1.0}
    assert engine_bundle(ray_plan(device="cuda"), cluster_gpus=0)["GPU"] == 1.0
    assert engine_bundle(ray_plan(resources={"zs": 1.0}), 0) == {"CPU": 1.0, "zs": 1.0}


def test_data_parallel_size_local_pins_the_first_ranks_to_the_supervisors_node():
    assert bundle_selectors(ray_plan(engines=3), "HEAD") == []
    assert bundle_selectors(ray_plan(engines=3, engines_on_head=1), "HEAD") == [
        {"ray.io/node-id": "HEAD"},
        {"ray.io/node-id": "!HEAD"},
        {"ray.io/node-id": "!HEAD"},
    ]


def test_a_cluster_that_can_hold_the_bundles_passes():
    nodes = [node("a", CPU=1.0), node("b", CPU=2.0)]
    assert shortfall({"CPU": 1.0}, 3, nodes, ray_plan(engines=3), "a") is None


def test_a_too_small_cluster_is_named_with_what_it_has():
    nodes = [node("a" * 12, CPU=4.0), node("b" * 12, CPU=1.0, zs=1.0), node("c", False, zs=9.0)]
    problem = shortfall({"CPU": 1.0, "zs": 1.0}, 2, nodes, ray_plan(), "a" * 12)
    assert problem.startswith(
        "2 engine(s) need 2 placement-group bundle(s) of {CPU: 1, zs: 1} on any node, and "
        "the Ray cluster has room for 1 (strategy SPREAD)"
    )
    assert "aaaaaaaa at 10.0.0.1 {CPU: 4}; bbbbbbbb at 10.0.0.1 {CPU: 1, zs: 1}" in problem
    assert "node:" not in problem and "memory" not in problem and "cccc" not in problem  # dead


def test_the_head_and_the_other_nodes_are_counted_apart_with_dpl():
    nodes = [node("head", CPU=8.0), node("w", CPU=1.0)]
    plan = ray_plan(engines=3, engines_on_head=1)
    assert "2 engine(s) need 2" in shortfall({"CPU": 1.0}, 3, nodes, plan, "head")
    assert "on the other nodes" in shortfall({"CPU": 1.0}, 3, nodes, plan, "head")
    assert shortfall({"CPU": 1.0}, 3, [*nodes, node("v", CPU=1.0)], plan, "head") is None


def test_strict_strategies_count_nodes_not_just_resources():
    nodes = [node("a", CPU=4.0), node("b", CPU=1.0)]
    spread = ray_plan(engines=3, strategy="STRICT_SPREAD")
    assert "room for 2" in shortfall({"CPU": 1.0}, 3, nodes, spread, "a")
    pack = ray_plan(engines=5, strategy="STRICT_PACK")
    assert "room for 4" in shortfall({"CPU": 1.0}, 5, nodes, pack, "a")
    assert describe_bundle({"GPU": 1.0, "CPU": 0.5}) == "{CPU: 0.5, GPU: 1}"
