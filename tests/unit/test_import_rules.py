"""DESIGN.md §1: who may import whom. Scans every import statement (including ones
inside functions) of every module of each package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> top-level modules it must never import
FORBIDDEN = {
    "protocol": {
        "torch",
        "transformers",
        "starlette",
        "uvicorn",
        "pydantic",
        "engine_core",
        "frontend",
        "launcher",
        "benchmarks",
        "safetensors",
        "fastapi",
    },
    "engine_core": {
        "frontend",
        "launcher",
        "benchmarks",
        "starlette",
        "uvicorn",
        "pydantic",
        "fastapi",
    },
    "frontend": {"engine_core", "launcher", "benchmarks", "torch", "safetensors", "fastapi"},
    "benchmarks": {"launcher", "frontend"},
}
# frontend may use transformers' tokenizer class, never AutoTokenizer (it imports torch)
FRONTEND_TRANSFORMERS_OK = {"PreTrainedTokenizerFast"}


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names], node.lineno))
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_design_table(package):
    problems = []
    for path in modules(package):
        for module, names, line in imports_of(path):
            top = module.split(".")[0]
            if top in FORBIDDEN[package]:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if package == "frontend" and top == "transformers":
                if module != "transformers" or not set(names) <= FRONTEND_TRANSFORMERS_OK:
                    problems.append(f"{path.relative_to(ROOT)}:{line} imports {module} {names}")
    assert not problems, "\n".join(problems)


def test_benchmarks_touch_engine_core_only_in_the_offline_engine_bench():
    for path in modules("benchmarks"):
        for module, _, line in imports_of(path):
            if module.split(".")[0] == "engine_core":
                # engine.py: the bench's command, which sets up threads before torch loads
                allowed = {"engine_measure.py", "engine.py"}
                assert path.name in allowed, f"{path.name}:{line} imports {module}"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import torch\n")
    assert [m for m, _, _ in imports_of(f)] == ["torch"]
