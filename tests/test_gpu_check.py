"""benchmarks/gpu_check.py, the command a lent GPU runs first, runs end to end here with --tiny."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.slow
def test_the_gpu_check_runs_tiny_and_prints_its_table(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--tiny",
            "--quant",
            "int8",
            "--attention-calls",
            "one",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    families = {"llada", "dream", "llada_moe", "sdar", "fast_dllm_v2", "llada2", "nemotron_labs_diffusion"}
    assert {r["family"] for r in rows} == families
    assert {(r["config"], r["batch"], r["weights"]) for r in rows if r["family"] == "llada"} == {
        (c, b, w) for c in ("baseline", "fast-dllm", "default") for b in (1, 2) for w in ("bf16", "int8")
    }
    assert all(r["tokens_per_second"] > 0 for r in rows)
    work = {r["config"]: r["positions_per_token"] for r in rows if r["family"] == "llada"}
    assert work["baseline"] > work["fast-dllm"] >= work["default"]  # the schedules' work, as recorded
    attention = json.loads(out.read_text())["attention"]  # the ragged-attention candidates, small
    assert [a["rows"] for a in attention] == [1, 4]
    for a in attention:
        assert isinstance(a["sdpa per row ms"], float) and a["sdpa per row max diff"] == 0.0
        assert a["sdpa padded max diff"] < 0.05 and a["flex kernel max diff"] < 0.05  # bf16
    assert "tok/s" in run.stdout and len(run.stdout.splitlines()) == len(rows) + 1 + len(attention)


@pytest.mark.slow
def test_the_gpu_check_adds_rows_of_the_captured_step_and_of_each_way_to_attend(tmp_path):
    out = tmp_path / "graphs.json"
    families = ("llada", "sdar", "nemotron_labs_diffusion")
    argv = ["benchmarks/gpu_check.py", "--tiny", "--families", *families, "--batch", "2", "--graphs"]
    run = subprocess.run(
        [sys.executable, *argv, "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    modes = ("eager:per_row", "eager:one", "graphs")  # the eager forwards' rows attending both ways
    assert {(r["family"], r["mode"]) for r in rows} == {(f, m) for f in families for m in modes}
    assert {r["batch"] for r in rows if r["mode"] == "eager:one"} == {2}  # one row attends alike either way
    assert all(r["tokens_per_second"] > 0 for r in rows)
