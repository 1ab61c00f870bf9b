"""deploy/kubernetes: every manifest is valid Kubernetes, and every zserve command line
in it is one zserve accepts, with probes, ports, keys and limits that match its flags.

Built-in kinds are validated against the schemas bundled with kubernetes-validate
(strict: unknown fields fail). The LeaderWorkerSet is a CRD: its top level is checked
against LWS_SCHEMA below, written from the LWS v1 API reference, whose pod templates
and metadata point into the bundled core schemas. Command lines go through what the
kubelet and the container do to them: `$(VAR)` expansion, then the real `/bin/sh`
with a `zserve` on PATH that records its argv, which zserve's own parser then reads.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from frontend.app import OPEN_PATHS, build_app
from launcher.cli import build_parser
from launcher.plan import LaunchPlan, build_plan, refuse_unsupported
from protocol.keys import KEY_NAME

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes release the README promises, and the newest bundled schema.
K8S_VERSIONS = ("1.30", "1.37")

# What the cluster would fill in, for the command lines' sake.
SAMPLE_VALUES = {
    "status.podIP": "10.244.1.7",
    "secret": "sample-api-key",
}
LWS_LEADER_ADDRESS = "zserve-lws-0.zserve-lws.default"

_K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"
_INT_OR_STRING = {"type": ["integer", "string"]}
LWS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"$ref": _K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "groupIdentity": {"enum": ["Ordinal", "Hash"]},
                "networkConfig": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["subdomainPolicy"],
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                },
                "rolloutStrategy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "partition": {"type": "integer", "minimum": 0},
                                "maxUnavailable": _INT_OR_STRING,
                                "maxSurge": _INT_OR_STRING,
                            },
                        },
                    },
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "leaderTemplate": {"$ref": _K8S + "io.k8s.api.core.v1.PodTemplateSpec"},
                        "workerTemplate": {"$ref": _K8S + "io.k8s.api.core.v1.PodTemplateSpec"},
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {
                            "enum": [
                                "RecreateGroupOnPodRestart",
                                "RecreateGroupAfterStart",
                                "None",
                                "Default",
                            ]
                        },
                        "subGroupPolicy": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["subGroupSize"],
                            "properties": {
                                "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                                "subGroupSize": {"type": "integer", "minimum": 1},
                            },
                        },
                        "volumeClaimTemplates": {
                            "type": "array",
                            "items": {"$ref": _K8S + "io.k8s.api.core.v1.PersistentVolumeClaim"},
                        },
                        "persistentVolumeClaimRetentionPolicy": {
                            "$ref": _K8S
                            + "io.k8s.api.apps.v1.StatefulSetPersistentVolumeClaimRetentionPolicy"
                        },
                    },
                },
            },
        },
    },
}


# --- loading and validating ---------------------------------------------------------


def manifests() -> list[tuple[str, dict]]:
    """(file name, resource) for every document of every manifest."""
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def validate_lws(doc: dict, version: str) -> None:
    """LWS_SCHEMA, with its $refs resolved in the bundled core schemas of `version`."""
    full = next(v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == version)
    definitions = kv_utils.schema_contents(
        f"kubernetes-json-schema/v{full}-local-strict/_definitions.json", version
    )
    registry = Resource.from_contents(definitions) @ Registry()
    jsonschema.Draft202012Validator(LWS_SCHEMA, registry=registry).validate(doc)


def validate(doc: dict, version: str) -> None:
    if doc["kind"] == "LeaderWorkerSet":
        validate_lws(doc, version)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_readme_names_every_manifest():
    readme = (MANIFESTS / "README.md").read_text()
    names = sorted(p.name for p in MANIFESTS.glob("*.yaml"))
    assert names, "no manifests found"
    for name in names:
        assert name in readme, f"{name} is not described in deploy/kubernetes/README.md"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    kinds = set()
    for name, doc in manifests():
        try:
            validate(doc, version)
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path)
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {path}: {e.message}")
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "LeaderWorkerSet", "PersistentVolumeClaim"} <= kinds


def _with_misspelled_container_field(doc: dict, template_path: list[str]) -> dict:
    bad = copy.deepcopy(doc)
    template = functools.reduce(dict.__getitem__, template_path, bad)
    template["spec"]["containers"][0]["readinesProbe"] = {"periodSeconds": 5}
    return bad


@pytest.mark.parametrize(
    "kind, template_path",
    [
        ("Deployment", ["spec", "template"]),
        ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "leaderTemplate"]),
        ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "workerTemplate"]),
    ],
)
def test_a_misspelled_container_field_fails_validation(kind, template_path):
    """The validation is strict down to the containers, LWS pod templates included."""
    (doc,) = of_kind(kind)
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        validate(_with_misspelled_container_field(doc, template_path), K8S_VERSIONS[0])


@pytest.mark.parametrize(
    "edit",
    [
        lambda spec: spec["leaderWorkerTemplate"].update(restartPolicy="Sometimes"),
        lambda spec: spec.update(startupPolicy="WorkersFirst"),
        lambda spec: spec.update(replica=2),
        lambda spec: spec["leaderWorkerTemplate"].update(size=0),
        lambda spec: spec["leaderWorkerTemplate"].pop("workerTemplate"),
    ],
)
def test_the_leaderworkerset_schema_refuses_what_lws_would(edit):
    (doc,) = of_kind("LeaderWorkerSet")
    bad = copy.deepcopy(doc)
    edit(bad["spec"])
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(bad, K8S_VERSIONS[0])


# --- the zserve command lines -------------------------------------------------------


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of command and args: `$(VAR)` becomes VAR's value when
    the container defines VAR (else it stays as written), `$$` becomes `$`."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env.get(name, text[i : end + 1]))
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def container_env(container: dict, injected: dict[str, str]) -> dict[str, str]:
    """The container's environment as the cluster would give it, with sample values."""
    env = dict(injected)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = kubelet_expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = SAMPLE_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = SAMPLE_VALUES["secret"]
        else:
            raise AssertionError(f"no sample value for env {var}")
    return env


def zserve_argv(container: dict, env: dict[str, str], tmp_path: Path) -> list[str]:
    """Run the container's command line with a `zserve` on PATH that records its argv."""
    argv = [kubelet_expand(a, env) for a in container["command"] + container.get("args", [])]
    for arg in argv:
        unresolved = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg)
        assert not unresolved, f"$({unresolved[0]}) is not defined in the container"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "zserve"
    shim.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ZSERVE_ARGV_FILE"\n')
    shim.chmod(0o755)
    record = tmp_path / "argv"
    record.unlink(missing_ok=True)
    run_env = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "ZSERVE_ARGV_FILE": str(record)}
    subprocess.run(argv, env=run_env, check=True, timeout=30)
    assert record.exists(), f"{argv[:3]} never ran zserve"
    return record.read_bytes().decode().split("\0")[:-1]


def parse_zserve(argv: list[str], env: dict[str, str]) -> tuple[argparse.Namespace, LaunchPlan]:
    """zserve's own parser and launch plan, under the container's environment (--api-key
    falls back to $ZSERVE_API_KEY when the plan is built)."""
    with pytest.MonkeyPatch.context() as m:
        if "ZSERVE_API_KEY" in env:
            m.setenv("ZSERVE_API_KEY", env["ZSERVE_API_KEY"])
        else:
            m.delenv("ZSERVE_API_KEY", raising=False)
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"zserve refuses the command line {argv}")
        assert args.command == "serve"
        problem = refuse_unsupported(args)
        assert problem is None, problem
        # The model folder is on a volume the cluster mounts: take it as found.
        plan = build_plan(args, args.model, args.model)
    return args, plan


@dataclass
class Pod:
    """One pod as the cluster would run it, and the flags its zserve got."""

    kind: str  # of the manifest that makes it
    where: str
    labels: dict
    spec: dict
    container: dict
    argv: list[str]
    args: argparse.Namespace
    plan: LaunchPlan


def pods(tmp_path: Path) -> list[Pod]:
    """Every pod the manifests make: the Deployment's, the LWS leader, each LWS worker."""
    found = []

    def add(kind, where, template, injected):
        (container,) = template["spec"]["containers"]
        env = container_env(container, injected)
        argv = zserve_argv(container, env, tmp_path)
        args, plan = parse_zserve(argv, env)
        found.append(
            Pod(
                kind=kind,
                where=where,
                labels=template["metadata"]["labels"],
                spec=template["spec"],
                container=container,
                argv=argv,
                args=args,
                plan=plan,
            )
        )

    for doc in of_kind("Deployment"):
        add("Deployment", f"Deployment/{doc['metadata']['name']}", doc["spec"]["template"], {})
    for doc in of_kind("LeaderWorkerSet"):
        lwt = doc["spec"]["leaderWorkerTemplate"]
        size = lwt["size"]
        lws = {"LWS_LEADER_ADDRESS": LWS_LEADER_ADDRESS, "LWS_GROUP_SIZE": str(size)}
        name = doc["metadata"]["name"]
        leader_env = {**lws, "LWS_WORKER_INDEX": "0"}
        add("LeaderWorkerSet", f"{name} leader", lwt["leaderTemplate"], leader_env)
        for index in range(1, size):
            add(
                "LeaderWorkerSet",
                f"{name} worker {index}",
                lwt["workerTemplate"],
                {**lws, "LWS_WORKER_INDEX": str(index)},
            )
    return found


@pytest.fixture(scope="module")
def all_pods(tmp_path_factory) -> list[Pod]:
    found = pods(tmp_path_factory.mktemp("pods"))
    assert {p.kind for p in found} == {"Deployment", "LeaderWorkerSet"}
    return found


def lws_group(all_pods: list[Pod]) -> list[Pod]:
    return [p for p in all_pods if p.kind == "LeaderWorkerSet"]


def heads(all_pods: list[Pod]) -> list[Pod]:
    return [p for p in all_pods if not p.args.headless]


def test_every_zserve_command_line_is_accepted_by_zserve(all_pods):
    for pod in all_pods:
        assert pod.args.model.startswith("/"), pod.where
        assert "--api-key" not in pod.argv, f"{pod.where}: the API key belongs in a Secret"


def test_the_model_comes_from_a_read_only_volume(all_pods):
    for pod in all_pods:
        mounts = [
            m
            for m in pod.container["volumeMounts"]
            if pod.args.model.startswith(m["mountPath"] + "/")
        ]
        assert mounts, f"{pod.where}: {pod.args.model} is on no volume"
        assert mounts[0]["readOnly"] is True


def test_heads_read_the_api_key_from_a_secret(all_pods):
    for pod in heads(all_pods):
        (var,) = [v for v in pod.container["env"] if v["name"] == "ZSERVE_API_KEY"]
        assert var["valueFrom"]["secretKeyRef"]["name"] == "zserve-api-key"
        assert pod.plan.frontend.api_key == SAMPLE_VALUES["secret"], pod.where
        assert pod.args.served_model_name, f"{pod.where}: clients need a stable model name"


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def test_probes_hit_open_zserve_routes_on_the_serving_port(all_pods):
    for pod in heads(all_pods):
        c, args = pod.container, pod.args
        app = build_app(SimpleNamespace(config=pod.plan.frontend))  # the routes; nothing is served
        routes = {route.path for route in app.routes}
        expected = {"readinessProbe": "/health", "livenessProbe": "/live", "startupProbe": "/live"}
        for probe, path in expected.items():
            get = c[probe]["httpGet"]
            assert get["path"] == path, f"{pod.where}: {probe}"
            assert path in routes
            assert path in OPEN_PATHS, f"{path} would need the API key, which probes lack"
            assert _port_number(c, get["port"]) == args.port, f"{pod.where}: {probe} port"


def test_headless_workers_have_no_http_probes(all_pods):
    for pod in all_pods:
        if pod.args.headless:
            assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(pod.container)


def test_the_startup_probe_outlasts_zserves_own_start_up_deadline(all_pods):
    for pod in heads(all_pods):
        probe = pod.container["startupProbe"]
        budget = (
            probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
        )
        assert budget > pod.args.engine_ready_timeout + 30, pod.where


def _pre_stop_seconds(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_the_grace_period_covers_the_drain(all_pods):
    """preStop, then --shutdown-timeout for requests, then the supervisor's 10 s for
    API servers and 10 s for engines (launcher/supervisor.py shutdown, STOP_GRACE_S)."""
    for pod in all_pods:
        grace = pod.spec["terminationGracePeriodSeconds"]
        drain = 0 if pod.args.headless else pod.args.shutdown_timeout + 10
        assert grace >= _pre_stop_seconds(pod.container) + drain + 10, pod.where
        if not pod.args.headless:
            assert pod.args.shutdown_timeout > 0, f"{pod.where}: SIGTERM would abort at once"


def test_workers_outlive_the_heads_drain(all_pods):
    for head in heads(all_pods):
        if head.args.data_parallel_size_local in (None, head.args.data_parallel_size):
            continue
        head_drain = _pre_stop_seconds(head.container) + head.args.shutdown_timeout
        for worker in all_pods:
            if worker.args.headless:
                assert _pre_stop_seconds(worker.container) >= head_drain, worker.where


def _cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_cpu_threads_fit_the_cpu_limit(all_pods):
    for pod in all_pods:
        resources = pod.container["resources"]
        assert resources["requests"] == resources["limits"], f"{pod.where}: Guaranteed QoS"
        args = pod.args
        local = (
            args.data_parallel_size
            if args.data_parallel_size_local is None
            else (args.data_parallel_size_local)
        )
        api_servers = 0 if args.headless else (args.api_server_count or args.data_parallel_size)
        assert args.cpu_threads is not None, f"{pod.where}: set --cpu-threads under a CPU quota"
        used = args.cpu_threads * local + api_servers
        assert used <= _cpus(resources["limits"]["cpu"]), pod.where


def test_engine_keys_come_from_a_root_only_secret_at_the_engine_keys_path(all_pods):
    multi_node = [p for p in all_pods if p.args.data_parallel_size_local is not None]
    assert multi_node
    for pod in multi_node:
        args = pod.args
        assert args.engine_keys, f"{pod.where}: needs --engine-keys"
        (mount,) = [m for m in pod.container["volumeMounts"] if m["mountPath"] == args.engine_keys]
        assert mount["readOnly"] is True
        (volume,) = [v for v in pod.spec["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == "zserve-engine-keys"
        assert secret["defaultMode"] in (0o400, 0o600), oct(secret["defaultMode"])
        assert f"{KEY_NAME}.key_secret" in {item["path"] for item in secret["items"]}
        # Secret files are owned by root; fsGroup would make them group-readable,
        # which zserve refuses for a secret key.
        security = pod.spec["securityContext"]
        assert security["runAsUser"] == 0 and "fsGroup" not in security, pod.where


def test_single_pod_deployment_needs_no_keys_and_runs_unprivileged(all_pods):
    (pod,) = [p for p in all_pods if p.kind == "Deployment"]
    assert pod.args.data_parallel_size_local is None and not pod.args.headless
    assert pod.args.api_server_count > 1 and pod.args.data_parallel_size > 1
    assert pod.spec["securityContext"]["runAsNonRoot"] is True


def test_lws_ranks_cover_the_data_parallel_size_once(all_pods):
    group = lws_group(all_pods)
    (head,) = heads(group)
    size = head.args.data_parallel_size
    ranks = []
    for pod in group:
        a = pod.args
        assert a.data_parallel_size == size, pod.where
        assert a.data_parallel_rpc_port == head.args.data_parallel_rpc_port, pod.where
        ranks += range(
            a.data_parallel_start_rank, a.data_parallel_start_rank + a.data_parallel_size_local
        )
    assert sorted(ranks) == list(range(size))
    assert len(group) >= 2, "a group of one pod is the Deployment's case"


def test_lws_head_binds_its_own_ip_and_workers_dial_the_leader_address(all_pods):
    group = lws_group(all_pods)
    for pod in group:
        if pod.args.headless:
            assert pod.args.data_parallel_address == LWS_LEADER_ADDRESS, pod.where
        else:
            assert pod.args.data_parallel_address == SAMPLE_VALUES["status.podIP"], pod.where
            ports = {p["containerPort"] for p in pod.container["ports"]}
            assert pod.args.data_parallel_rpc_port in ports


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_service_selects_only_heads_on_their_http_port(all_pods):
    services = of_kind("Service")
    lws_names = {doc["metadata"]["name"] for doc in of_kind("LeaderWorkerSet")}
    assert services
    for service in services:
        # LWS owns a headless Service named after the LeaderWorkerSet.
        assert service["metadata"]["name"] not in lws_names
        selected = [p for p in all_pods if _selects(service["spec"]["selector"], p.labels)]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for pod in selected:
            assert not pod.args.headless, f"{service['metadata']['name']} selects {pod.where}"
            for port in service["spec"]["ports"]:
                assert _port_number(pod.container, port["targetPort"]) == pod.args.port


def test_both_lws_templates_agree_on_engines_per_pod():
    (doc,) = of_kind("LeaderWorkerSet")
    lwt = doc["spec"]["leaderWorkerTemplate"]
    values = set()
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        (container,) = template["spec"]["containers"]
        values |= {v["value"] for v in container["env"] if v["name"] == "ENGINES_PER_POD"}
    assert len(values) == 1


def test_kubelet_expansion_leaves_shell_arithmetic_alone():
    env = {"A": "1"}
    assert kubelet_expand("$(A) $$(A) $((A * 2)) $(B)", env) == "1 $(A) $((A * 2)) $(B)"
