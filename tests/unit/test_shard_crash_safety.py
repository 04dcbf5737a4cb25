"""Crash safety of the shard dataset writer under SIGKILL.

The writer (``_crash_writer.child_main``: the production ``ShardWriter`` fed by a
deterministic state source) runs in a child process that stops before each file-system call
in the dataset directory until the test lets it continue. The test SIGKILLs it at random
calls (>= 20 times), restarts it (it resumes from disk) and, after every kill, checks what a
reader would see. At the end the directory must equal an uninterrupted run byte for byte.
The same kill schedule applied to the naive in-place writer must be caught.

Children are forked from a forkserver that has imported torch once: a fresh interpreter
costs 4-5 s of imports on this machine, times 25 restarts. Each child is its own process
with its own pid, killed with a real SIGKILL.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path

import _crash_writer as cw
import pytest
import torch

from vllm_compat.eagle3.data import MANIFEST, DatasetFormatError, HiddenStatesDataset, read_manifest

KILLS = 30
# A seeded schedule whose kills land in all six dangerous windows (the test asserts it; when
# the writer's call sequence changes, a seed may stop covering one: pick another).
SEED = int(os.environ.get("VC_CRASH_SEED", "3"))
MAX_KILL_AT = 40  # calls into a life; committing a shard takes ~27 calls (a full run: ~400)


@pytest.fixture(scope="module")
def ctx():
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["torch", "safetensors.torch", "vllm_compat.eagle3.data"])  # not _crash_writer: 3.11 preloads before applying sys.path
    return c


@dataclass
class Life:
    events: list[str] = field(default_factory=list)
    killed: bool = False
    error: str | None = None


def live(ctx, directory: Path, mode: str, kill_at: int | None) -> Life:
    """One run of the writer; SIGKILL it just before its ``kill_at``-th file-system call."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=cw.child_main, args=(str(directory), child, mode), daemon=True)
    p.start()
    child.close()
    life = Life()
    try:
        while True:
            assert parent.poll(60), f"writer silent for 60 s after {life.events[-3:]}"
            try:
                msg = parent.recv()
            except EOFError:
                break
            if msg == "done":
                continue
            if msg.startswith("error "):
                life.error = msg[6:]
                continue
            life.events.append(msg)
            if kill_at is not None and len(life.events) == kill_at:
                os.kill(p.pid, signal.SIGKILL)
                p.join(30)
                assert p.exitcode == -signal.SIGKILL
                life.killed = True
                return life
            parent.send(True)
    finally:
        parent.close()
    p.join(30)
    assert life.error is not None or p.exitcode == 0, p.exitcode
    return life


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(d: Path) -> dict[str, str]:
    return {p.name: sha(p) for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def reference(ctx, tmp_path_factory):
    d = tmp_path_factory.mktemp("reference")
    life = live(ctx, d, "atomic", None)
    assert life.error is None and not life.killed
    m = read_manifest(d)
    assert m.num_samples == cw.NUM_SAMPLES and len(m.shards) == 11
    return d, snapshot(d), m, len(life.events)


def visible_problems(d: Path, ref_files: dict[str, str], ref_manifest) -> list[str]:
    """What is wrong with the directory as a reader (or a resumed writer) sees it now, as
    ``"<file>: <problem>"``; [] when all is well."""
    if not (d / MANIFEST).exists() and not any(p.suffix == ".safetensors" for p in d.iterdir()):
        return []  # killed before the first manifest commit: nothing was ever visible
    try:
        m = read_manifest(d)
    except DatasetFormatError as e:
        return [f"{MANIFEST}: unreadable ({e})"]
    problems = []
    committed = [s["file"] for s in m.shards]
    pending = {m.pending["file"]} if m.pending else set()
    present = {p.name for p in d.iterdir() if p.name.endswith(".safetensors")}
    # every file under a final shard name is a complete shard: the reference run's bytes
    for name in sorted(present):
        if name not in ref_files or sha(d / name) != ref_files[name]:
            problems.append(f"{name}: partial or wrong shard visible under its final name")
    for name in sorted(set(committed) - present):
        problems.append(f"{name}: listed in the manifest but missing")
    for name in sorted(present - set(committed) - pending):
        problems.append(f"{name}: shard file not in the manifest")
    if len(set(committed)) != len(committed):
        problems.append(f"{MANIFEST}: duplicate shard entries {committed}")
    # the committed entries (file, counts, size, sha256) are a prefix of the reference run's
    if m.shards != ref_manifest.shards[: len(m.shards)]:
        problems.append(f"{MANIFEST}: entries differ from the uninterrupted run's")
    if problems:
        return problems
    # the reader sees exactly samples 0..n-1, each once, with the right values
    ds = HiddenStatesDataset(d, verify="full")
    got = [int(s["index"]) for s in ds]
    if got != list(range(m.num_samples)):
        problems.append(f"reader: sees samples {got}")
    for s in ds:
        want = cw.sample(int(s["index"]))
        if not all(torch.equal(s[k], want[k].to(s[k].dtype)) for k in want):
            problems.append(f"reader: sample {int(s['index'])} differs")
    return problems


def windows(events: list[str]) -> set[str]:
    """The dangerous windows a kill before ``events[-1]`` landed in."""
    nxt, prev = events[-1], (events[-2] if len(events) > 1 else "")
    found = set()
    if nxt.startswith("write shard") and prev.startswith("write shard"):
        found.add("mid shard write")
    # the shard's .tmp is complete and durable, not yet renamed: since 2026-11-29 the intent is
    # recorded in this window (its sha256 is computed beside the write)
    shard_events = [i for i, e in enumerate(events[:-1]) if e.split(" ")[1:2] and e.split(" ")[1].startswith("shard-")]
    if shard_events and events[shard_events[-1]].startswith("fsync shard"):
        found.add("shard written, not renamed")
        if not any(e.startswith("replace manifest") for e in events[shard_events[-1]:-1]):
            found.add("shard written, intent not recorded")
    renamed = [i for i, e in enumerate(events[:-1]) if e.startswith("replace shard")]
    if renamed and not any(e.startswith("replace manifest") for e in events[renamed[-1]:-1]):
        found.add("shard renamed, manifest not committed")
    if nxt.startswith("write manifest") and prev.startswith("write manifest"):
        found.add("mid manifest write")
    if nxt.startswith("replace manifest"):
        found.add("manifest written, not renamed")
    return found


ALL_WINDOWS = {"mid shard write", "shard written, intent not recorded", "shard written, not renamed",
               "shard renamed, manifest not committed", "mid manifest write", "manifest written, not renamed"}


def kill_schedule(n: int) -> list[int]:
    rng = random.Random(SEED)
    return [rng.randint(1, MAX_KILL_AT) for _ in range(n)]


def test_sigkill_at_random_points_then_resume_equals_uninterrupted_run(ctx, reference, tmp_path):
    _, ref_files, ref_manifest, _ = reference
    d = tmp_path / "ds"
    hit: set[str] = set()
    kills = 0
    for kill_at in kill_schedule(KILLS):
        before = read_manifest(d).num_samples if (d / MANIFEST).exists() else 0
        life = live(ctx, d, "atomic", kill_at)
        assert life.error is None, life.error
        if not life.killed:
            break  # finished before the kill point
        kills += before < cw.NUM_SAMPLES
        hit |= windows(life.events)
        assert visible_problems(d, ref_files, ref_manifest) == [], f"after a kill before {life.events[-1]!r}"
    assert kills >= 20, f"only {kills} kills landed before the dataset was complete"
    assert hit == ALL_WINDOWS  # the random points include every dangerous window
    life = live(ctx, d, "atomic", None)  # the last restart runs to the end
    assert life.error is None and not life.killed
    assert snapshot(d) == ref_files  # same file list, same bytes (manifest included), no .lock left


def test_resumed_writer_recovers_a_killed_commit(ctx, reference, tmp_path):
    """Kill exactly between the shard's rename and the manifest commit (the window where a
    complete, uncommitted shard is on disk): the reader ignores it, the resumed writer keeps
    it (its sha256 matches the intent) and the result is still byte-identical."""
    _, ref_files, ref_manifest, _ = reference
    d = tmp_path / "ds"
    probe = live(ctx, tmp_path / "probe", "atomic", None)  # the call sequence of a full run
    renamed = probe.events.index("replace shard-00000.safetensors.tmp shard-00000.safetensors")
    # after the rename: directory fsync, then the manifest commit starts; kill right there
    life = live(ctx, d, "atomic", renamed + 4)
    assert life.killed and life.events[-3:] == ["open .", "fsync .", "open manifest.json.tmp"]
    m = read_manifest(d)
    assert m.shards == [] and m.pending["file"] == "shard-00000.safetensors"
    assert (d / "shard-00000.safetensors").exists()
    assert visible_problems(d, ref_files, ref_manifest) == []
    assert len(HiddenStatesDataset(d)) == 0  # pending shards are not part of the dataset
    life = live(ctx, d, "atomic", None)
    assert "unlink shard-00000.safetensors" not in life.events  # kept, not redone
    assert "open shard-00000.safetensors.tmp" not in life.events
    assert snapshot(d) == ref_files


@pytest.mark.parametrize("mode, expected", [
    ("in_place", "partial or wrong shard visible under its final name"),
    ("no_intent", "shard file not in the manifest"),
])
def test_broken_writers_are_caught_under_the_same_schedule(ctx, reference, tmp_path, mode, expected):
    """The broken things (see _crash_writer): writing in place, or committing a shard without
    recording the intent first. Under the same kill schedule the checks above catch them,
    and the reader refuses every damaged state with an error that names the damaged file."""
    _, ref_files, ref_manifest, _ = reference
    d = tmp_path / "ds"
    caught = []
    for kill_at in kill_schedule(KILLS):
        life = live(ctx, d, mode, kill_at)
        if life.error is not None or not life.killed:
            break  # the writer cannot reopen what it left (or finished)
        problems = visible_problems(d, ref_files, ref_manifest)
        if problems:
            damaged = problems[0].split(": ")[0]
            with pytest.raises(DatasetFormatError) as err:
                HiddenStatesDataset(d)
            caught.append((damaged, problems[0], str(err.value)))
    assert any(expected in p for _, p, _ in caught), caught
    for damaged, _, message in caught:
        assert message.startswith(f"{d / damaged}: "), (damaged, message)
    if mode == "in_place":  # a torn manifest: the writer itself cannot resume, the run is lost
        assert life.error is not None
        assert life.error.startswith(f"DatasetFormatError: {d / MANIFEST}: not valid JSON")
