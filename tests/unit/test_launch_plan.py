"""The launch plan: every alias and flag-dependent default settled in one place, the
parsed flags never changed, refusals as clear messages."""

from __future__ import annotations

import argparse
import copy

import pytest

from launcher import plan, serve_args
from launcher.plan import LaunchRefused, build_plan, plan_launch


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zserve")
    serve_args.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def planned(*argv: str) -> plan.LaunchPlan:
    return build_plan(parse("m", *argv), "/models/m", "/models/m")


@pytest.mark.parametrize(
    ("flag", "dtype"),
    [("half", "float16"), ("float", "float32"), ("bf16", "bfloat16"), ("auto", "auto")],
)
def test_vllm_dtype_spellings_become_the_engines(flag, dtype):
    assert planned("--dtype", flag).engine.dtype == dtype


def test_model_impl_vllm_means_the_native_forward():
    assert planned("--model-impl", "vllm").engine.model_impl == "native"
    assert planned("--model-impl", "transformers").engine.model_impl == "transformers"


def test_counts_default_to_the_data_parallel_size_and_the_flags_stay_untouched():
    args = parse("m", "-dp", "2")
    before = copy.deepcopy(vars(args))
    p = build_plan(args, "/models/m", "/models/m")
    assert vars(args) == before
    assert (p.topology.api_server_count, p.topology.local_engines) == (2, 2)
    assert p.frontend.api_server_count == 2 and p.frontend.num_engines == 2
    assert p.engine.data_parallel_size_local == 2
    assert p.topology.all_local and list(p.topology.local_ranks) == [0, 1]


def test_engine_threads_count_the_settled_api_servers(monkeypatch):
    monkeypatch.setattr(plan, "usable_cores", lambda: 8)
    # -dp 2: two API servers by default, so one core is kept for the second.
    assert planned("-dp", "2").engine.cpu_threads == 3
    assert planned("-dp", "2", "--api-server-count", "1").engine.cpu_threads == 4


def test_the_api_key_comes_from_the_flag_or_else_the_environment(monkeypatch):
    monkeypatch.setenv("ZSERVE_API_KEY", "from-env")
    assert planned().frontend.api_key == "from-env"
    assert planned("--api-key", "from-flag").frontend.api_key == "from-flag"
    monkeypatch.delenv("ZSERVE_API_KEY")
    assert planned().frontend.api_key is None


def test_a_chat_template_flag_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert planned("--chat-template", str(path)).frontend.chat_template == "{{ messages }}"
    assert planned("--chat-template", "{{ x }}").frontend.chat_template == "{{ x }}"


def test_request_lines_are_off_unless_enabled_and_not_disabled():
    assert planned().frontend.enable_log_requests is False
    assert planned("--enable-log-requests").frontend.enable_log_requests is True
    both = planned("--enable-log-requests", "--disable-log-requests")
    assert both.frontend.enable_log_requests is False


def test_limit_flags_reach_the_request_limits():
    limits = planned("--max-request-body-bytes", "1MiB", "--max-chat-messages", "7").frontend
    assert (limits.limits.max_body_bytes, limits.limits.max_messages) == (1 << 20, 7)


def test_a_headless_worker_plans_engines_and_no_api_servers():
    p = build_plan(
        parse(
            "m", "--headless", "-dp", "4", "-dpl", "2", "-dpr", "2",
            "-dpa", "10.0.0.1", "-dpp", "13345", "--engine-cpus", "0-3",
        ),
        "/models/m",
        "/models/m",
    )  # fmt: skip
    assert p.frontend is None
    assert list(p.topology.local_ranks) == [2, 3] and not p.topology.all_local
    assert p.engine_cpus == [[0, 1], [2, 3]]
    assert p.topology.handshake_address("/run") == "tcp://10.0.0.1:13345"


def test_refusals_and_missing_models_stop_the_launch_with_their_message(tmp_path):
    with pytest.raises(LaunchRefused, match="--trust-remote-code is refused"):
        plan_launch(parse("m", "--trust-remote-code"))
    with pytest.raises(LaunchRefused, match="does not exist"):
        plan_launch(parse(str(tmp_path / "nope")))


def test_the_ray_backend_plans_actors_not_local_engines(monkeypatch):
    monkeypatch.setattr(plan.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    p = planned(
        "-dp", "3", "-dpl", "1", "--data-parallel-backend", "ray", "--cpu-threads", "2",
        "--ray-engine-resources", '{"zs": 1}', "--engine-restart-policy", "on-failure",
    )  # fmt: skip
    assert p.topology.local_engines == 0 and not p.topology.all_local
    assert p.topology.rpc_port == 0 and p.topology.head_address is None  # bound, then told
    assert p.engine.cpu_threads == 2 and p.engine_restart_policy == "on-failure"
    assert p.ray.address == "10.0.0.9:6379" and p.ray.engines == 3
    assert p.ray.engines_on_head == 1 and p.ray.resources == {"zs": 1.0}
    assert planned("--ray-address", "h:1", "-dpb", "ray").ray.address == "h:1"
    assert planned().ray is None and planned().engine_restart_policy == "never"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-dpb", "ray"], "pass --ray-address HOST:PORT or set RAY_ADDRESS"),
        (["-dpb", "ray", "--ray-address", "h:1", "--engine-cpus", "0"], "--engine-cpus does not"),
        (["-dpb", "ray", "--ray-address", "h:1", "-dpr", "1"], "--data-parallel-start-rank"),
        (
            ["-dp", "2", "-dpl", "1", "-dpa", "h", "-dpp", "9", "--engine-restart-policy",
             "on-failure"],
            "engines of headless workers are not restarted",
        ),
    ],
)  # fmt: skip
def test_the_ray_backend_and_restart_policy_refuse_what_they_cannot_honour(
    monkeypatch, argv, message
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(plan.importlib.util, "find_spec", lambda name: object())
    assert message in plan.refuse_unsupported(parse("m", *argv))


def test_the_ray_backend_without_ray_installed_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(plan.importlib.util, "find_spec", lambda name: None)
    problem = plan.refuse_unsupported(parse("m", "-dpb", "ray", "--ray-address", "h:1"))
    assert "needs the ray package (pip install ray)" in problem


@pytest.mark.parametrize(
    "text", ['{"CPU": 2}', '["zs"]', '{"zs": -1}', '{"": 1}', "zs=1", '{"zs": "1"}']
)
def test_ray_engine_resources_must_be_named_non_negative_amounts(text, capsys):
    with pytest.raises(SystemExit):
        parse("m", "--ray-engine-resources", text)
    assert "--ray-engine-resources" in capsys.readouterr().err
