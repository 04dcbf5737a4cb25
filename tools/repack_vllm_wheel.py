"""Repack a vLLM wheel as a simulated nightly: a new version string, optionally edited code.

    python tools/repack_vllm_wheel.py WHEEL --version 0.34.0.dev43+g5d6e7f8 \\
        [--edit tools/repack_edits/move_init_none_hash.py ...] [-o OUTDIR]

What it does to the unpacked wheel, in order:

1. ``<name>-<old>.dist-info/METADATA``: the ``Version:`` line.
2. ``vllm/_version.py`` (setuptools-scm's file): ``__version__`` / ``version`` and the version
   tuple, so ``vllm.__version__`` agrees with the metadata.
3. Each ``--edit`` script: a Python file whose ``edit(root: pathlib.Path)`` changes the unpacked
   tree (``root`` holds ``vllm/`` and the ``.dist-info``); ``tools/repack_edits/`` has two.
4. The ``.dist-info`` directory renamed for the new version, ``RECORD`` rewritten (sha256 and
   size of every file, as the wheel spec wants), and the wheel zipped as
   ``<name>-<new version>-<the original tags>.whl``.

The result installs like any wheel (``nox -s nightly -- <the .whl>``), so a maintainer can try
vllm_compat against "a nightly that moved a symbol" without waiting for vLLM to do it. See
docs/nightlies.md.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import re
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import Version


def record_hash(data: bytes) -> str:
    """``sha256=<urlsafe base64, no padding>``, the RECORD form."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _dist_info(root: Path) -> Path:
    found = [p for p in root.iterdir() if p.is_dir() and p.name.endswith(".dist-info")]
    if len(found) != 1:
        raise SystemExit(f"expected one .dist-info directory in the wheel, found {found}")
    return found[0]


def set_metadata_version(dist_info: Path, version: str) -> str:
    meta = dist_info / "METADATA"
    text = meta.read_text(encoding="utf-8")
    old = re.search(r"^Version: (.+)$", text, re.M)
    if old is None:
        raise SystemExit(f"no Version: line in {meta}")
    meta.write_text(text[:old.start(1)] + version + text[old.end(1):], encoding="utf-8")
    return old.group(1).strip()


def version_tuple(version: str) -> tuple:
    """What setuptools-scm writes as ``version_tuple`` (``0.34.0.dev43+g5d6e7f8`` ->
    ``(0, 34, 0, 'dev43', 'g5d6e7f8')``)."""
    v = Version(version)
    parts: list = list(v.release)
    if v.pre is not None:
        parts.append(f"{v.pre[0]}{v.pre[1]}")
    if v.post is not None:
        parts.append(f"post{v.post}")
    if v.dev is not None:
        parts.append(f"dev{v.dev}")
    if v.local is not None:
        parts.append(v.local)
    return tuple(parts)


def set_module_version(root: Path, package: str, old: str, version: str) -> bool:
    path = root / package / "_version.py"
    if not path.exists():
        return False
    text = path.read_text(encoding="utf-8")
    text = text.replace(repr(old), repr(version)).replace(f'"{old}"', repr(version))
    text = re.sub(r"^(__version_tuple__ = version_tuple = ).*$",
                  lambda m: m.group(1) + repr(version_tuple(version)), text, flags=re.M)
    path.write_text(text, encoding="utf-8")
    return True


def run_edit(script: Path, root: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"repack_edit_{script.stem}", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "edit", None)):
        raise SystemExit(f"{script} defines no edit(root)")
    module.edit(root)


def write_record(root: Path, dist_info: Path) -> None:
    """RECORD as CSV (vLLM ships files whose names hold commas: they must be quoted)."""
    rel_record = f"{dist_info.name}/RECORD"
    rows = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == rel_record:
            continue
        data = path.read_bytes()
        rows.append((rel, record_hash(data), str(len(data))))
    rows.append((rel_record, "", ""))
    with open(root / rel_record, "w", encoding="utf-8", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def zip_tree(root: Path, out: Path, modes: dict[str, int]) -> None:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    # the .dist-info last, as the wheel spec recommends
    files.sort(key=lambda p: p.relative_to(root).parts[0].endswith(".dist-info"))
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            rel = path.relative_to(root).as_posix()
            info = zipfile.ZipInfo(rel, date_time=(2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = modes.get(rel, 0o644 << 16)
            zf.writestr(info, path.read_bytes())


def repack(wheel: Path, version: str, edits: list[Path], out_dir: Path) -> Path:
    Version(version)  # a PEP 440 version, or InvalidVersion
    name, old_version, *tags = wheel.name[:-len(".whl")].split("-")
    with tempfile.TemporaryDirectory(prefix="repack-") as tmp:
        root = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(root)
            modes = {i.filename: i.external_attr for i in zf.infolist()}
        dist_info = _dist_info(root)
        old = set_metadata_version(dist_info, version)
        set_module_version(root, name, old, version)
        for script in edits:
            run_edit(script, root)
        new_dist_info = dist_info.with_name(f"{name}-{version}.dist-info")
        dist_info.rename(new_dist_info)
        modes = {k.replace(f"{dist_info.name}/", f"{new_dist_info.name}/", 1): v
                 for k, v in modes.items()}
        write_record(root, new_dist_info)
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / ("-".join([name, version, *tags]) + ".whl")
        zip_tree(root, out, modes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--version", required=True, help="the new version, e.g. 0.34.0.dev43+g5d6e7f8")
    parser.add_argument("--edit", type=Path, action="append", default=[],
                        help="a script with edit(root) that changes the unpacked wheel (repeatable)")
    parser.add_argument("-o", "--out-dir", type=Path, default=Path("dist"))
    args = parser.parse_args(argv)
    out = repack(args.wheel, args.version, args.edit, args.out_dir)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
