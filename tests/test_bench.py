"""A --quick bench run produces the table, the JSON with every figure, and the plots."""

from __future__ import annotations

import json

import pytest

from fastdllm import GenerationConfig
from fastdllm.cli.bench import main as bench_main
from fastdllm.evaluation import bench

FIGURES = {
    "accuracy",
    "tokens_per_second",
    "nfe_per_sample",
    "tokens_per_step",
    "aup",
    "latency_s",
    "speedup",
    "outside_forward",
    "config",
    "num_samples",
    "positions_per_token",
    "attended_per_token",
}


@pytest.mark.slow
def test_quick_bench_writes_table_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    assert bench_main(["--quick", "--limit", "2", "--out", str(out), "--device", "cpu"]) == 0
    table = (out / "bench.md").read_text()
    assert "+parallel +dual cache (Fast-dLLM)" in table and "| baseline |" in table
    record = json.loads((out / "bench.json").read_text())
    rows = record["rows"]
    # the paper's seven rows, the three beyond it, the default and the default with 2 and 3 blocks at
    # once; then baseline, Fast-dLLM, the combined policies, the default and its multi-block rows
    # with stop-at-EOS
    assert len(rows) == len(bench.TABLE_ROWS) + 6 and len(bench.TABLE_ROWS) == 13
    default = next(r for r in rows if r["name"].startswith("default (") and "stop@eos" not in r["name"])
    d = GenerationConfig()
    assert [default["config"][k] for k in ("cache", "threshold", "suffix_window", "refresh")] == [
        d.cache,
        d.threshold,
        d.suffix_window,
        d.refresh,
    ]
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
    assert len(record["plots"]) == 5 and "accuracy_vs_parallelism.png" in record["plots"]
    # AUP from the group's baseline: the baseline's is its own point, one with more tokens per
    # forward and its accuracy holding scores above it
    assert baseline["aup"] == pytest.approx(baseline["tokens_per_step"] * 100 * baseline["accuracy"])
    assert "| AUP |" in table
    # the baseline without stop-at-EOS computes the whole sequence once per generated position
    assert baseline["positions_per_token"] > full["positions_per_token"] > 0


@pytest.mark.slow
def test_rows_pick_table_rows_and_keep_the_baseline(tmp_path):
    out = tmp_path / "bench"
    argv = ["--quick", "--limit", "1", "--rows", "full", "--no-sweeps", "--no-batch-check", "--out", str(out)]
    assert bench_main(argv) == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [
        "baseline",
        "+parallel +dual cache (Fast-dLLM)",
        "baseline [stop@eos]",
        "+parallel +dual cache (Fast-dLLM) [stop@eos]",
    ]
    assert bench.table_rows(64, 32, "off", ["dual"])[1].config.cache == "dual"
    assert len(bench.table_rows(64, 32, "on", ["factor"])) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdar-arith", "llada2-arith"])
def test_a_block_diffusion_bench_runs_its_own_rows_in_its_own_blocks(tmp_path, name):
    out = tmp_path / "bench"
    argv = ["--quick", "--model", name, "--limit", "2", "--stop-at-eos", "off", "--no-batch-check", "--out", str(out)]
    assert bench_main(argv) == 0
    record = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in record["rows"]}
    editing = bench.EDITING_ROWS if name == "llada2-arith" else []  # LLaDA2.1's modes for the LLaDA2 line
    assert list(rows) == [name for _, name, _ in bench.BLOCK_DIFFUSION_ROWS + editing]
    assert all(
        (r["config"]["editing_threshold"] is not None) == (r["name"] in {n for _, n, _ in editing})
        for r in rows.values()
    )
    assert all(r["config"]["block_length"] == 4 for r in rows.values())
    baseline, exact = rows["baseline (no cache, one token per step)"], rows["+exact block cache"]
    assert exact["nfe_per_sample"] == baseline["nfe_per_sample"]  # the same steps, smaller forwards
    assert exact["positions_per_token"] < baseline["positions_per_token"] / 5
    assert set(record["sweeps"]) == {"threshold"}  # its block is its attention's: no block sweep
    for name in record["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_plots_keep_every_label_readable(tmp_path):
    """Fifteen rows, most at one accuracy and close speeds (what gen 256 gives): after drawing,
    no two pieces of text overlap, every one is inside the canvas, the axes keep a fair share of
    it, and the frontier keeps exactly the undominated rows."""
    import matplotlib

    matplotlib.use("Agg")
    from fastdllm.evaluation.bench import TABLE_ROWS, pareto, scatter_plot

    names = [name for _, name, _ in TABLE_ROWS] + [
        "baseline [stop@eos]",
        "+parallel +dual cache (Fast-dLLM) [stop@eos]",
        "default (Fast-dLLM +suffix window 32 +vicinity refresh) [stop@eos]",
        "Fast-dLLM +suffix window 64 +vicinity refresh [stop@eos]",
    ]
    rows = [
        {
            "name": n,
            "group": "gen 256, 0-shot",
            "accuracy": 1.0 if i else 0.96,
            "tokens_per_second": 30.0 * (1 + i * 0.07),
            "positions_per_token": 400 / (1 + i),
        }
        for i, n in enumerate(names)
    ]
    fig = scatter_plot(tmp_path / "p.png", rows, lambda r: r["tokens_per_second"], "tokens/s", "t", True)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas, axes = fig.bbox, fig.axes[0]
    frame = axes.get_window_extent(renderer)

    def drawn(t) -> bool:  # the tick labels of ticks outside the view exist but are not drawn
        box = t.get_window_extent(renderer)
        if t in axes.xaxis.get_ticklabels(which="both"):
            return frame.x0 - 1 <= (box.x0 + box.x1) / 2 <= frame.x1 + 1
        if t in axes.yaxis.get_ticklabels(which="both"):
            return frame.y0 - 1 <= (box.y0 + box.y1) / 2 <= frame.y1 + 1
        return True

    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip() and drawn(t)]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for t, b in zip(texts, boxes):
        assert b.x0 >= canvas.x0 - 1 and b.x1 <= canvas.x1 + 1 and b.y0 >= canvas.y0 - 1 and b.y1 <= canvas.y1 + 1, (
            t.get_text()
        )
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert all(any(n in label for label in legend_labels) for n in names)
    ax = fig.axes[0].get_window_extent(renderer)
    assert ax.width * ax.height >= 0.3 * canvas.width * canvas.height
    # the frontier: the fastest of the 100% rows, and the slower, less accurate baseline is not dominated by it
    front = pareto([(r["tokens_per_second"], r["accuracy"]) for r in rows])
    assert front == [len(rows) - 1]
    assert pareto([(1, 0.5), (2, 0.4), (3, 0.9)]) == [2]
    assert pareto([(1, 0.9), (2, 0.5), (3, 0.4)]) == [0, 1, 2]
    assert pareto([(5, 0.9), (1, 0.5)], higher_x_better=False) == [1, 0]


@pytest.mark.slow
def test_the_calibrated_view_reaches_its_tokens_per_step():
    import fastdllm
    from fastdllm.evaluation.bench import calibrate_confidence

    model, tok = fastdllm.load(dtype="float32")
    cfg = fastdllm.GenerationConfig.fast_dllm(gen_length=64, block_length=32)
    temp, per_step = calibrate_confidence(model, tok, cfg, target=3.0, limit=8, rounds=8)
    assert temp > 1.0 and abs(per_step - 3.0) < 0.75


def test_multi_block_rows_extend_the_default_and_a_block_diffusion_models_own_decoding(tiny_sdar):
    from fastdllm.evaluation.bench import table_rows

    rows = table_rows(256, 32, "off", keys=["multi-block-2", "multi-block-3"])
    assert [r.config.parallel_blocks for r in rows] == [1, 2, 3]  # the baseline, then the two
    assert all(r.config.suffix_window == 32 and r.config.refresh == "vicinity" for r in rows[1:])
    block = table_rows(64, 32, "off", keys=["multi-block-2"], model=tiny_sdar)
    assert [r.config.parallel_blocks for r in block] == [1, 2] and block[1].config.block_length == 4
