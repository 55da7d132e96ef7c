"""A --quick bench run produces the table, the JSON with every figure, and the plots."""

from __future__ import annotations

import pytest

import json

from fastdllm import GenerationConfig, bench
from fastdllm.commands.bench import main as bench_main

FIGURES = {"accuracy", "tokens_per_second", "nfe_per_sample", "tokens_per_step", "latency_s", "speedup",
           "outside_forward", "config", "num_samples", "positions_per_token", "attended_per_token"}


@pytest.mark.slow
def test_quick_bench_writes_table_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    assert bench_main(["--quick", "--limit", "2", "--out", str(out), "--device", "cpu"]) == 0
    table = (out / "bench.md").read_text()
    assert "+parallel +dual cache (Fast-dLLM)" in table and "| baseline |" in table
    record = json.loads((out / "bench.json").read_text())
    rows = record["rows"]
    # the paper's seven rows, the three beyond it and the default, then baseline, Fast-dLLM, the
    # combined policies and the default with stop-at-EOS
    assert len(rows) == len(bench.TABLE_ROWS) + 4 and len(bench.TABLE_ROWS) == 11
    default = next(r for r in rows if r["name"].startswith("default (") and "stop@eos" not in r["name"])
    d = GenerationConfig()
    assert [default["config"][k] for k in ("cache", "threshold", "suffix_window", "refresh")] == \
        [d.cache, d.threshold, d.suffix_window, d.refresh]
    for r in rows:
        assert FIGURES <= set(r), FIGURES - set(r)
        if r["name"].startswith("baseline"):
            assert r["speedup"] == 1.0
    baseline = next(r for r in rows if r["name"] == "baseline")
    assert baseline["config"]["cache"] == "none" and baseline["config"]["threshold"] is None
    assert baseline["nfe_per_sample"] == baseline["config"]["gen_length"]  # one token per step, no stop
    full = next(r for r in rows if r["name"] == "+parallel +dual cache (Fast-dLLM)")
    assert full["config"]["cache"] == "dual" and full["config"]["threshold"] == 0.9
    assert full["nfe_per_sample"] <= baseline["nfe_per_sample"] / 4
    # measured side by side: ~28x fewer forwards cannot all be eaten by timing noise
    assert full["speedup"] > 2 and full["tokens_per_second"] > 2 * baseline["tokens_per_second"]
    assert {"threshold", "block_length"} <= set(record["sweeps"]) and record["batch"]["ratio"] > 0
    assert record["environment"]["torch"] and record["settings"]["quick"] is True
    for name in record["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(record["plots"]) == 4
    # the baseline without stop-at-EOS computes the whole sequence once per generated position
    assert baseline["positions_per_token"] > full["positions_per_token"] > 0


@pytest.mark.slow
def test_rows_pick_table_rows_and_keep_the_baseline(tmp_path):
    out = tmp_path / "bench"
    argv = ["--quick", "--limit", "1", "--rows", "full", "--no-sweeps", "--no-batch-check", "--out", str(out)]
    assert bench_main(argv) == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["baseline", "+parallel +dual cache (Fast-dLLM)",
                                         "baseline [stop@eos]", "+parallel +dual cache (Fast-dLLM) [stop@eos]"]
    assert bench.table_rows(64, 32, "off", ["dual"])[1].config.cache == "dual"
    assert len(bench.table_rows(64, 32, "on", ["factor"])) == 2


@pytest.mark.slow
def test_a_block_diffusion_bench_runs_its_own_rows_in_its_own_blocks(tmp_path):
    out = tmp_path / "bench"
    argv = ["--quick", "--model", "sdar-arith", "--limit", "2", "--stop-at-eos", "off", "--no-batch-check",
            "--out", str(out)]
    assert bench_main(argv) == 0
    record = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == [name for _, name, _ in bench.BLOCK_DIFFUSION_ROWS]
    assert all(r["config"]["block_length"] == 4 for r in rows.values())
    baseline, exact = rows["baseline (no cache, one token per step)"], rows["+exact block cache"]
    assert exact["nfe_per_sample"] == baseline["nfe_per_sample"]  # the same steps, smaller forwards
    assert exact["positions_per_token"] < baseline["positions_per_token"] / 5
    assert set(record["sweeps"]) == {"threshold"}  # its block is its attention's: no block sweep
    for name in record["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
