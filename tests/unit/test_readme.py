"""README.md's test command is the one CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if "pytest" in line and not line.startswith("#")]
    assert len(command) == 1
    readme = (ROOT / "README.md").read_text()
    assert "    " + command[0] + "\n" in readme


def test_readme_serve_command_starts_zserve_serve():
    readme = (ROOT / "README.md").read_text()
    assert "zserve serve" in readme.split("## Serving a model")[0]
