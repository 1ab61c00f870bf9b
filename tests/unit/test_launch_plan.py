"""The launch plan: every alias and flag-dependent default settled in one place, the
parsed flags never changed, refusals as clear messages."""

from __future__ import annotations

import argparse
import copy
import json

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


def test_engines_spare_a_core_for_the_api_servers_unless_the_user_placed_the_threads():
    assert planned().engine.spare_core_for_frontend
    assert planned("-dp", "2").engine.spare_core_for_frontend
    for placed in (["--cpu-threads", "2"], ["--engine-cpus", "0"], ["--api-server-cpus", "0"]):
        assert not planned(*placed).engine.spare_core_for_frontend, placed
    headless = ["--headless", "-dp", "2", "--data-parallel-size-local", "2"]
    headless += ["--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345"]
    assert not planned(*headless).engine.spare_core_for_frontend


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


# --- development and profiler routes (issue 18) -----------------------------------------


def test_dev_routes_are_off_by_default_and_on_by_flag_or_environment(monkeypatch, caplog):
    monkeypatch.delenv("ZSERVE_SERVER_DEV_MODE", raising=False)
    assert not planned().frontend.enable_dev_routes
    with caplog.at_level("WARNING", logger="zserve.supervisor"):
        assert planned("--enable-dev-routes").frontend.enable_dev_routes
    assert "SECURITY" in caplog.text and "--enable-dev-routes" in caplog.text
    caplog.clear()
    for value, enabled in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("ZSERVE_SERVER_DEV_MODE", value)
        assert planned().frontend.enable_dev_routes is enabled, value
    assert "ZSERVE_SERVER_DEV_MODE=1" in caplog.text
    monkeypatch.setenv("ZSERVE_SERVER_DEV_MODE", "yes please")
    with pytest.raises(LaunchRefused, match="ZSERVE_SERVER_DEV_MODE must be 0 or 1"):
        planned()


def test_wait_while_asleep_reaches_the_api_servers():
    assert planned().frontend.wait_while_asleep_s == 0.0
    assert planned("--wait-while-asleep", "2.5").frontend.wait_while_asleep_s == 2.5


def test_profiler_config_reaches_every_engine_and_turns_the_routes_on(tmp_path):
    p = planned()
    assert p.engine.profiler is None and not p.frontend.enable_profiler_routes
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(tmp_path / "traces"),
        "torch_profiler_record_shapes": True,
        "torch_profiler_use_gzip": False,
        "ignore_frontend": True,
        "delay_iterations": 0,
    }
    p = planned("--profiler-config", json.dumps(config))
    assert p.frontend.enable_profiler_routes
    profiler = p.engine.profiler
    assert profiler.torch_profiler_dir == str(tmp_path / "traces")
    assert profiler.torch_profiler_record_shapes and not profiler.torch_profiler_use_gzip
    assert profiler.torch_profiler_with_stack  # vLLM's default
    worker = build_plan(
        parse("m", "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", "10.0.0.1",
              "-dpp", "5555", "--profiler-config", json.dumps(config)),
        "/models/m", "/models/m",
    )  # fmt: skip
    assert worker.engine.profiler == profiler  # headless engines profile too


def test_profiler_config_relative_dirs_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = planned("--profiler-config", '{"torch_profiler_dir": "traces"}')
    assert p.engine.profiler.torch_profiler_dir == str(tmp_path / "traces")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"profiler": "torch"}', "torch_profiler_dir must be set"),
        ('{"profiler": "cuda", "torch_profiler_dir": "/t"}', "'cuda' is not supported"),
        ('{"torch_profiler_dir": "/t", "bogus": 1}', "unknown fields ['bogus']"),
        ('{"torch_profiler_dir": "/t", "max_iterations": 3}', "max_iterations is not supported"),
        ('{"torch_profiler_dir": "/t", "torch_profiler_with_stack": "yes"}', "true or false"),
    ],
)
def test_bad_profiler_configs_are_refused_naming_the_field(text, message, capsys):
    with pytest.raises(SystemExit):
        parse("m", "--profiler-config", text)
    assert message in capsys.readouterr().err


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


@pytest.mark.parametrize("text", ["0", "-0.5", "1.5", "nan", "inf", "half"])
def test_gpu_memory_utilization_must_be_a_share_of_the_device(text, capsys):
    with pytest.raises(SystemExit):
        parse("m", "--gpu-memory-utilization", text)
    assert "--gpu-memory-utilization" in capsys.readouterr().err


def test_gpu_memory_utilization_takes_a_share_up_to_the_whole_device():
    assert parse("m", "--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0
    assert parse("m", "--gpu-memory-utilization", "0.5").gpu_memory_utilization == 0.5
