"""Tensor parallelism on torch.distributed: 2 ranks (gloo, loopback) started by torchrun, as users
start them; every family split by `fastdllm.models.tp` against one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

WORKER = Path(__file__).parent / "distributed" / "tp_worker.py"
FAMILIES = ["tiny_llada", "tiny_dream", "tiny_sdar", "tiny_v2", "tiny_llada2", "tiny_llada_moe"]
QUESTION = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"


def torchrun(*args: str, ranks: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_every_family_split_over_two_ranks_decodes_as_one_process(tmp_path):
    """Logits within float32 rounding of the whole model's, the same tokens for a batch of two, and
    every rank deciding alike; GQA with fewer kv heads than ranks (tiny_llada2) included; and the
    same for int8 and int4 checkpoints, each rank reading its part of the quantized layers."""
    out = tmp_path / "tp.json"
    run = torchrun(str(WORKER), str(out), *FAMILIES)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results.pop("ranks_agree") is True
    assert set(results) == set(FAMILIES)
    for name, r in results.items():
        assert r["max_logit_diff"] < 1e-4 and r["same_tokens"], (name, r)
        assert r["all_reduces_per_layer"] == 2  # one after attention, one after the MLP
        assert r["read_parts_equal"]  # a rank reading only its parts from the files gets the same
        assert r["weight_bytes_per_rank"] < r["weight_bytes"]
        for bits, q in r["quantized"].items():  # int8 per channel, int4 in groups of 32 columns
            assert q["max_logit_diff"] < 1e-4 and q["same_tokens"], (name, bits, q)
    assert results["tiny_llada2"]["kv_heads_per_rank"] == 1 and results["tiny_v2"]["heads_per_rank"] == 2


@pytest.mark.slow
def test_generate_with_tp_prints_one_processes_answer():
    one = subprocess.run(
        [sys.executable, "-m", "fastdllm", "generate", "--dtype", "float32", "--json", QUESTION],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    two = torchrun("-m", "fastdllm", "generate", "--tp", "2", "--dtype", "float32", "--json", QUESTION)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout)["text"] == json.loads(one.stdout)["text"]  # printed once, by rank 0
    wrong = torchrun("-m", "fastdllm", "generate", "--tp", "4", QUESTION)
    assert wrong.returncode != 0 and "tp: 4, but torchrun started 2 processes" in wrong.stderr


def test_tp_says_how_to_launch_and_which_commands_take_it():
    alone = subprocess.run(
        [sys.executable, "-m", "fastdllm", "generate", "--tp", "2", QUESTION],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert alone.returncode == 2 and "torchrun --nproc-per-node 2 -m fastdllm <command> --tp 2" in alone.stderr
    other = subprocess.run(
        [sys.executable, "-m", "fastdllm", "chat", "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert other.returncode == 2 and "--tp: this command does not run tensor-parallel yet" in other.stderr


@pytest.mark.slow
def test_eval_with_tp_decodes_every_sample_on_every_rank(tmp_path):
    """Not sharded by sample: both ranks decode all of them with their halves of the model; rank 0
    writes the results, which are one process's."""
    flags = ["--task", "arith", "--limit", "6", "--dtype", "float32"]
    one = subprocess.run(
        [sys.executable, "-m", "fastdllm", "eval", *flags, "--log-samples", str(tmp_path / "1.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    two = torchrun("-m", "fastdllm", "eval", *flags, "--tp", "2", "--log-samples", str(tmp_path / "2.jsonl"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    outputs = [
        [json.loads(line)["output"] for line in (tmp_path / f).read_text().splitlines()] for f in ("1.jsonl", "2.jsonl")
    ]
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]
    assert two.stdout.count("accuracy") == 1  # printed once
