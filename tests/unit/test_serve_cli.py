"""``vllm-compat serve-hidden-states``: launch_vllm.py's flags and layer ids, ``vllm serve``
flags after ``--``, and one-line errors (exit 2) for user mistakes."""

from __future__ import annotations

import argparse

import pytest

from vllm_compat.cli import main
from vllm_compat.serve import cli as serve_cli


@pytest.mark.parametrize("L, given, last, want", [
    (32, None, True, [2, 16, 29, 32]),
    (32, None, False, [2, 16, 29, 32]),  # launch_vllm.py's default always ends with L
    (32, [3, 10], True, [3, 10, 32]),
    (32, [3, 10], False, [3, 10]),
    (32, [3, 32], True, [3, 32]),
    (61, None, True, [2, 30, 58, 61]),
])
def test_layer_ids_as_launch_vllm_builds_them(L, given, last, want):
    assert serve_cli.layer_ids_like_launch_vllm(L, given, last) == want


@pytest.mark.parametrize("L, given", [(4, None), (32, [3, 3]), (32, [40]), (32, [-1])])
def test_bad_layer_ids_are_refused_like_launch_vllm(L, given):
    with pytest.raises(ValueError, match="ids must be distinct and within"):
        serve_cli.layer_ids_like_launch_vllm(L, given)


def parse(argv):
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    ours, tail = serve_cli.split_vllm_args(["serve-hidden-states", *argv])
    args = parser.parse_args(ours)
    args.vllm_args = tail
    serve_cli._vllm_tail(args, tail)
    return args


def test_vllm_serve_flags_before_or_after_the_separator():
    a = parse(["/m", "--hidden-states-backend", "fp8", "--target-layer-ids", "1", "2", "--",
               "--port", "8123", "--max-model-len", "4096", "-tp", "2",
               "--gpu-memory-utilization", "0.8"])
    assert (a.hidden_states_backend, a.target_layer_ids) == ("fp8", [1, 2])
    assert (a.port, a.max_model_len, a.tensor_parallel_size, a.gpu_memory_utilization) == (
        8123, 4096, 2, 0.8)
    b = parse(["/m", "--port", "9000"])
    assert b.port == 9000 and b.hidden_states_path == "/tmp/hidden_states"


def test_unsupported_vllm_flags_are_named():
    with pytest.raises(ValueError, match="--data-parallel-size 2"):
        parse(["/m", "--", "--data-parallel-size", "2"])


@pytest.mark.parametrize("argv, words", [
    (["serve-hidden-states", "/does/not/exist"], "/does/not/exist"),
    (["serve-hidden-states", "/m", "--hidden-states-backend", "mooncake"], "mooncake"),
    (["serve-hidden-states", "/m", "--", "--pipeline-parallel-size", "2"],
     "--pipeline-parallel-size"),
])
def test_user_mistakes_are_one_line_and_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vllm-compat serve-hidden-states: error: ")
    assert words in err[0]


def test_separator_is_only_for_serve_hidden_states(capsys):
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--", "--port", "1"])
    assert info.value.code == 2
