"""--data-parallel-backend ray on a real multi-node Ray cluster, all on this machine
(issue 20): engines as actors on separate nodes, balanced traffic, an actor crash and
a lost node survived with --engine-restart-policy on-failure, the default policy
failing the server, clear start-up errors, and a teardown that leaves nothing.

One cluster serves the module (Ray starts slowly): a head node with one CPU and two
worker nodes with one CPU and the custom resource `zs_engine` each, 100 MB object
stores, every address on loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from engine_rejoin import engines_served, kill_mid_stream_and_rejoin
from test_failures import MODEL, SMALL_KV
from zserve_proc import ZServe, free_port, listening_ports, port_is_free, server_info, wait_for

# Ray swaps 127.0.0.1 in an address for this machine's interface address unless it
# believes multi-node clusters are off (its switch for laptops): with it, every Ray
# address, the GCS's included, stays on loopback. Read when ray is imported.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK)
ray = pytest.importorskip("ray", reason="the ray package is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENGINE_HINT = ("--ray-engine-resources", '{"zs_engine": 1}')


def node_args(temp_dir: str, **resources) -> dict:
    return dict(
        num_cpus=1,
        resources=resources,
        node_ip_address="127.0.0.1",
        object_store_memory=100 * 1024 * 1024,
        temp_dir=temp_dir,
    )


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Ray's nodes, their workers and agents), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def cluster():
    before = descendants(os.getpid())
    temp_dir = tempfile.mkdtemp(prefix="zsray-")  # short: Ray's socket paths live here
    # Ray's test Cluster records the head's address in its default temp folder
    # (/tmp/ray) whatever temp folder the head uses, and fails where that folder does
    # not exist yet, as on a fresh machine.
    os.makedirs(os.path.join(os.environ.get("TMPDIR", "/tmp"), "ray"), exist_ok=True)
    try:
        c = Cluster(
            initialize_head=True,
            head_node_args={**node_args(temp_dir), "include_dashboard": False},
        )
    except Exception as e:
        shutil.rmtree(temp_dir, ignore_errors=True)
        pytest.skip(f"Ray cannot start a cluster on this machine: {e}")
    try:
        for _ in range(2):
            c.add_node(**node_args(temp_dir, zs_engine=1))
        c.wait_for_nodes()
        c.zs_temp_dir = temp_dir  # for nodes added by a test
        yield c
    finally:
        c.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    # the process table: no Ray process (GCS, raylets, workers, agents) left behind
    wait_for(lambda: not descendants(os.getpid()) - before, timeout=30, interval=0.2)


def ray_server(cluster: Cluster, model: Path, *flags: str, wait_ready: bool = True) -> ZServe:
    return ZServe(
        str(model),
        "--served-model-name",
        MODEL,
        *SMALL_KV,
        "--data-parallel-backend",
        "ray",
        "--ray-address",
        cluster.address,
        "--data-parallel-address",
        "127.0.0.1",
        "--enable-dev-routes",  # /server_info shows where each engine runs
        *flags,
        env=LOOPBACK,
        wait_ready=wait_ready,
    )


def worker_ids(cluster: Cluster) -> set[str]:
    return {n.node_id for n in cluster.worker_nodes}


def all_resources_free(cluster: Cluster) -> bool:
    """Every CPU and zs_engine of the cluster free again: no bundle, no actor holds one."""
    total, free = (
        cluster.global_state.cluster_resources(),
        cluster.global_state.available_resources(),
    )
    return all(free.get(k, 0) == total[k] for k in ("CPU", "zs_engine"))


def test_engines_are_ray_actors_on_separate_nodes_and_come_back_after_a_crash_or_a_lost_node(
    cluster, small_model
):
    server = ray_server(
        cluster, small_model, "-dp", "2", *ENGINE_HINT, "--engine-restart-policy", "on-failure"
    )
    with server:
        engines = server_info(server.base_url)["engines"]
        nodes = [e["node_id"] for e in engines]
        assert len(set(nodes)) == 2 and set(nodes) <= worker_ids(cluster)  # the hint held
        assert all(e["hostname"] for e in engines)
        log = server.log()
        for index in (0, 1):  # the engines' links end on loopback, whatever Ray reports
            assert f"API server {index} binds tcp://127.0.0.1:" in log
        assert engines_served(server.base_url) == {"0", "1"}
        # an engine's process crashes: Ray reports the actor dead, a new one takes its bundle
        _, after = kill_mid_stream_and_rejoin(
            server, 1, lambda e: os.kill(e["pid"], signal.SIGKILL), api_servers=2
        )
        assert after["node_id"] == nodes[1]
        # a node is lost: the bundle moves to a node that joins, and the engine with it
        spare = cluster.add_node(**node_args(cluster.zs_temp_dir, zs_engine=1))
        lost = next(n for n in cluster.worker_nodes if n.node_id == nodes[0])
        _, after = kill_mid_stream_and_rejoin(
            server, 0, lambda e: cluster.remove_node(lost), api_servers=2
        )
        assert after["node_id"] == spare.node_id
        assert engines_served(server.base_url) == {"0", "1"}
        assert "its node has died" in server.log()
        engine_pids = [e["pid"] for e in server_info(server.base_url)["engines"]]
        ports = listening_ports(server.pids())
        assert server.stop() == 0
    # a clean teardown: no engine actor, no bundle, no socket of the server left. An
    # actor's worker process is ended by its node's raylet after `ray.kill`, a moment
    # after the supervisor has gone: a busy machine makes that moment longer.
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in engine_pids),
        timeout=30,
        interval=0.2,
    )
    wait_for(lambda: all_resources_free(cluster), timeout=30, interval=0.2)
    assert all(port_is_free(p) for p in ports)


def test_without_the_restart_policy_an_actor_death_fails_the_server(cluster, tiny_model):
    # -dpl 1: rank 0 on the supervisor's own Ray node (the head), rank 1 elsewhere
    server = ray_server(cluster, tiny_model("llama"), "-dp", "2", "-dpl", "1")
    with server:
        engines = server_info(server.base_url)["engines"]
        head = cluster.head_node.node_id
        assert engines[0]["node_id"] == head and engines[1]["node_id"] != head
        os.kill(engines[1]["pid"], signal.SIGKILL)
        server.proc.wait(60)
        assert server.proc.returncode == 1
        log = server.log()
        assert "engine 1's Ray actor died" in log and "failing the server" in log
    wait_for(lambda: all_resources_free(cluster), timeout=30, interval=0.2)


def test_a_cluster_too_small_for_the_engines_is_a_clear_start_up_error(cluster, tiny_model):
    server = ray_server(cluster, tiny_model("llama"), "-dp", "3", *ENGINE_HINT, wait_ready=False)
    with server:
        assert server.proc.wait(120) == 1
        log = server.log()
        assert "cannot place the engines on the Ray cluster" in log
        assert "3 engine(s) need 3 placement-group bundle(s) of {CPU: 1, zs_engine: 1}" in log
        assert "room for 2" in log
    assert all_resources_free(cluster)


def test_no_cluster_at_the_address_is_a_clear_start_up_error(tiny_model):
    address = f"127.0.0.1:{free_port()}"
    server = ZServe(
        str(tiny_model("llama")),
        *("--data-parallel-backend", "ray", "--ray-address", address),
        env=LOOPBACK,
        wait_ready=False,
    )
    with server:
        t0 = time.monotonic()
        assert server.proc.wait(60) == 1
        assert f"no Ray cluster answers at {address}" in server.log()
        print(f"refused in {time.monotonic() - t0:.1f} s")
