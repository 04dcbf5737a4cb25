"""README.md opens with two commands, the demo and the tests, and ``.ci/run`` runs the tests
with the README's command exactly as printed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "python3 -m pip install -q uv nox && "


def readme_commands() -> list[str]:
    """The commands of the README's first code block, comments removed."""
    first = re.search(r"^```[a-z]*\n(.*?)^```", (ROOT / "README.md").read_text(),
                      flags=re.DOTALL | re.MULTILINE)
    assert first is not None, "README.md has no code block"
    return [line.split(" #", 1)[0].strip() for line in first.group(1).splitlines() if line.strip()]


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip().startswith(INSTALL)]


def test_readme_opens_with_the_demo_and_the_test_command():
    demo, tests = readme_commands()
    assert demo == INSTALL + "python3 -m nox -s demo"
    assert tests.startswith(INSTALL + "python3 -m nox -s ")


def test_ci_runs_the_readme_test_command_as_printed():
    assert ci_commands() == [readme_commands()[1]]
