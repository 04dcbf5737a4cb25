"""The support table shows what each release's drift check found, and which runs had none."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("matrix_report", ROOT / "matrix" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_table_has_the_drift_check_of_each_run(tmp_path):
    (tmp_path / "matrix" / "results").mkdir(parents=True)
    (tmp_path / "matrix" / "releases.toml").write_text('releases = ["0.29.0", "0.30.0", "0.31.0", "0.32.0"]\n')
    base = {"passed": True, "tests": 113, "failures": 0, "errors": 0, "skipped": 0, "seconds": 400.4,
            "finished": "2026-12-01T20:48:04Z"}
    results = {
        "0.29.0": dict(base, adapter="v0_29", drift={"summary": "drift check against 0.29.0: no drift"}),
        "0.30.0": dict(base, adapter="v0_29", drift={
            "summary": "drift check against 0.30.0: 1 change, affects requests"}, passed=False, failures=2),
        "0.31.0": dict(base, tests=38, seconds=120.0, finished="2026-11-29T10:48:28Z"),  # before the check
    }
    for rel, r in results.items():
        (tmp_path / "matrix" / "results" / f"{rel}.json").write_text(json.dumps(r))
    rows = _report().table(tmp_path).splitlines()
    assert rows[0].split(" | ")[6] == "drift check"
    assert rows[2:] == [
        "| 0.29.0 | v0_29 | pass | 113 | 0 | 0 | no drift | 400 | 2026-12-01T20:48:04Z |",
        "| 0.30.0 | v0_29 | **FAIL** | 111 | 0 | 2 | 1 change, affects requests | 400 | 2026-12-01T20:48:04Z |",
        "| 0.31.0 | v0_29 | pass | 38 | 0 | 0 | not recorded | 120 | 2026-11-29T10:48:28Z |",
        "| 0.32.0 | v0_29 | not run | | | | | | |",
    ]


def test_pages_say_what_the_results_say():
    """docs/support-matrix.md and the README's table and summary are what matrix/results/
    holds (after a conformance run: `nox -s matrix_report`)."""
    assert _report().check(ROOT) == []


def _copy_repo(dst: Path) -> Path:
    for rel in ("README.md", "docs/support-matrix.md", "matrix/NOTES.md", "matrix/releases.toml",
                *(str(p.relative_to(ROOT)) for p in (ROOT / "matrix" / "results").glob("*.json"))):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_bytes((ROOT / rel).read_bytes())
    return dst


def test_check_finds_a_page_the_results_no_longer_support(tmp_path):
    report = _report()
    root = _copy_repo(tmp_path)
    assert report.main(["--check", "--root", str(root)]) == 0
    result = root / "matrix" / "results" / "0.30.0.json"
    r = json.loads(result.read_text())
    result.write_text(json.dumps(dict(r, passed=False, failures=1, tests=200)))  # above every real run: the new top of the range
    stale = report.check(root)
    assert [line.split()[0] for line in stale] == ["docs/support-matrix.md", "README.md's"]
    assert report.main(["--check", "--root", str(root)]) == 1
    assert report.main(["--root", str(root)]) == 0  # regenerate: the pages follow the results
    assert report.check(root) == []
    readme = (root / "README.md").read_text()
    assert "failing on 0.30.0" in readme and "102–200 tests per release" in readme
    assert "| 0.30.0 | v0_29 | **FAIL** | 199 | 0 | 1 |" in readme


def test_check_finds_prose_edited_against_the_table(tmp_path):
    report = _report()
    root = _copy_repo(tmp_path)
    page = root / "docs" / "support-matrix.md"
    page.write_text(re.sub(r"102–\d+ tests", "51 tests", page.read_text()))
    assert report.check(root) == ["docs/support-matrix.md differs from matrix/results/ "
                                  "(run `nox -s matrix_report`)"]
    readme = root / "README.md"
    page.write_text(report.page(root))
    tested = re.search(r"\*\*0\.10\.2 to [0-9.]+\*\*", readme.read_text()).group(0)  # the newest release
    readme.write_text(readme.read_text().replace(tested, tested.replace(".0**", ".x**")))
    assert report.check(root) == [f"README.md does not state the tested range as {tested}"]
