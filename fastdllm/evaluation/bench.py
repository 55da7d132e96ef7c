"""`fastdllm bench`: Fast-dLLM's tables on your machine and model, side by side, in one run.

Every configuration decodes the same prompts in the same process, so the speed-up column is a
ratio of figures measured together (this matters on shared, noisy machines). Rows follow the
paper's Table 1 / Table 3: baseline (LLaDA: no cache, one token per step, block 32), + prefix
cache, + DualCache, + parallel (threshold 0.9), + parallel with prefix cache, + parallel with
DualCache (the full method), and factor decoding. By default every row runs with stop-at-EOS off
(as the paper) and the baseline and full method are repeated with it on.

Metrics are the evaluation harness's (`fastdllm.evaluation.harness`): accuracy; tokens/s = generated tokens
up to the first EOS or stop sequence divided by generation wall time; NFE per sample; tokens per
step; mean latency per sample; and the share of wall time spent outside the model's forward.

Outputs in --out: bench.md (the table), bench.json (every figure, the settings, machine and library
versions), and plots: accuracy vs tokens/s, a threshold sweep and a block-size sweep.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..quant import weight_bytes
from .aup import aup


@dataclass
class Row:
    name: str
    config: GenerationConfig
    group: str  # rows are compared with the baseline of their group


# (key for --rows, name in the table, settings): the paper's Table 1 / Table 3 rows.
TABLE_ROWS = [
    ("baseline", "baseline", dict(cache="none", threshold=None)),
    ("prefix", "+prefix cache", dict(cache="prefix", threshold=None)),
    ("dual", "+dual cache", dict(cache="dual", threshold=None)),
    ("parallel", "+parallel (threshold 0.9)", dict(cache="none", threshold=0.9)),
    ("parallel-prefix", "+parallel +prefix cache", dict(cache="prefix", threshold=0.9)),
    ("full", "+parallel +dual cache (Fast-dLLM)", dict(cache="dual", threshold=0.9)),
    ("factor", "factor 1.0 +dual cache", dict(cache="dual", threshold=None, factor=1.0)),
    # beyond Fast-dLLM
    ("suffix", "Fast-dLLM +suffix window 64 (after DPad)", dict(cache="dual", threshold=0.9, suffix_window=64)),
    ("vicinity", "Fast-dLLM +vicinity refresh (after dInfer)", dict(cache="dual", threshold=0.9, refresh="vicinity")),
    (
        "beyond",
        "Fast-dLLM +suffix window 64 +vicinity refresh",
        dict(cache="dual", threshold=0.9, suffix_window=64, refresh="vicinity"),
    ),
    (
        "default",
        "default (Fast-dLLM +suffix window 32 +vicinity refresh)",
        dict(cache="dual", threshold=0.9, suffix_window=32, refresh="vicinity"),
    ),
]


# Multi-block decoding (after D2F): the row it extends (the default; a block-diffusion model's own
# decoding), with 2 and 3 blocks decoded at once.
def multi_block_rows(table: list[tuple], base: str) -> list[tuple]:
    """Row `base` of `table` with parallel_blocks 2 and 3 (keys multi-block-2, multi-block-3)."""
    return [
        (f"multi-block-{n}", f"{name} +{n} blocks at once (after D2F)", dict(kw, parallel_blocks=n))
        for key, name, kw in table
        if key == base
        for n in (2, 3)
    ]


TABLE_ROWS += multi_block_rows(TABLE_ROWS, "default")
# A block-diffusion model (block-causal attention) decodes in its own blocks and its cache is exact:
# the rows are its one-token-per-step baseline, the exact cache, parallel decoding, and both (its
# family's own decoding, `Family.decoding_defaults`).
NO_CACHE = dict(cache="none", suffix_window=None, refresh="full")
BLOCK_DIFFUSION_ROWS = [
    ("baseline", "baseline (no cache, one token per step)", dict(NO_CACHE, threshold=None)),
    ("exact", "+exact block cache", dict(threshold=None)),
    ("parallel", "+parallel (threshold 0.9)", dict(NO_CACHE, threshold=0.9)),
    ("full", "+parallel +exact block cache", dict(threshold=0.9)),
]
BLOCK_DIFFUSION_ROWS += multi_block_rows(BLOCK_DIFFUSION_ROWS, "full")
# LLaDA2.1's token editing, in its published quality and speed modes, for the LLaDA2 line's models.
EDITING_ROWS = [
    (
        "edit-quality",
        "+token editing, quality mode (threshold 0.7, editing 0.5)",
        dict(threshold=0.7, editing_threshold=0.5),
    ),
    (
        "edit-speed",
        "+token editing, speed mode (threshold 0.5, editing 0.0)",
        dict(threshold=0.5, editing_threshold=0.0),
    ),
]
ROW_KEYS = list(dict.fromkeys(key for key, _, _ in TABLE_ROWS + BLOCK_DIFFUSION_ROWS + EDITING_ROWS))


def table_rows(gen_length: int, block_length: int, stop_at_eos: str, keys=None, model=None) -> list[Row]:
    """The rows to run; `keys` picks some (the baseline always runs: speed-ups are relative to it).
    For a block-diffusion `model`, its own rows in its own blocks (`block_length` is ignored), and
    for the LLaDA2 line LLaDA2.1's editing modes too."""
    g = f"gen {gen_length}"
    block_causal = model is not None and model.args.block_size
    # The rows name their policies in full: they do not move with GenerationConfig's defaults.
    base = dict(
        gen_length=gen_length,
        block_length=block_length,
        steps=gen_length,
        stop_at_eos=False,
        suffix_window=None,
        refresh="full",
        refresh_every=None,
    )
    table = BLOCK_DIFFUSION_ROWS if block_causal else TABLE_ROWS
    if block_causal and model.family.rules.proposal == "llada2":
        table = table + EDITING_ROWS

    def config(**kw):
        if block_causal:  # what the family needs (its block, its exact cache), then the row's settings
            return GenerationConfig.for_model(
                model, GenerationConfig(gen_length=gen_length, steps=gen_length), checkpoint_defaults=False, **kw
            )
        return GenerationConfig(**{**base, **kw})

    rows = [row for row in table if keys is None or row[0] in keys or row[0] == "baseline"]
    out = []
    if stop_at_eos in ("off", "both"):
        out += [Row(name, config(**kw, stop_at_eos=False), g) for _, name, kw in rows]
    if stop_at_eos in ("on", "both"):
        # "both": only the baseline and the full method are repeated with stop-at-EOS
        picked = (
            rows
            if stop_at_eos == "on"
            else [
                row
                for row in rows
                if row[0] in ("baseline", "full", "beyond", "default") or row[0].startswith("multi-block")
            ]
        )
        out += [Row(name + " [stop@eos]", config(**kw, stop_at_eos=True), g + " stop@eos") for _, name, kw in picked]
    return out


# Tokens per step a real model reveals at threshold 0.9: LLaDA-8B on GSM8K at gen 256 reveals about
# two to three (the embedded models, far more confident, 13 to 16).
REAL_TOKENS_PER_STEP = 2.5


def calibrate_confidence(
    model,
    tokenizer,
    config,
    task: str = "arith",
    target: float = REAL_TOKENS_PER_STEP,
    limit: int = 16,
    rounds: int = 10,
) -> tuple[float, float]:
    """(temperature, tokens per step): the confidence temperature at which `config` (threshold
    0.9, the model's full method) reveals `target` tokens per step on the task's first `limit`
    problems, by bisection on its logarithm. Confidences only: the greedy tokens stay the model's."""
    import math

    def tokens_per_step(t: float) -> float:
        return run_config(model, tokenizer, task, config.replace(confidence_temperature=t), 0, limit, 8)[
            "tokens_per_step"
        ]

    lo, hi = 0.0, 4.0  # log2 of the temperature
    measured = {}
    for _ in range(rounds):
        mid = (lo + hi) / 2
        measured[mid] = tokens_per_step(2**mid)
        lo, hi = (mid, hi) if measured[mid] > target else (lo, mid)
    best = min(measured, key=lambda k: abs(measured[k] - target))
    return round(2**best, 4), measured[best] if not math.isnan(measured[best]) else 0.0


def run_config(
    model,
    tokenizer,
    task: str,
    config,
    num_fewshot: int,
    limit: int | None,
    batch_size: int,
    data_dir: str | None = None,
) -> dict:
    """One bench row: `config` evaluated on `task`, its accuracy, speed and work."""
    from .harness import evaluate

    m = evaluate(
        model,
        tokenizer,
        task,
        limit=limit,
        num_fewshot=num_fewshot,
        config=config,
        batch_size=batch_size,
        data_dir=data_dir,
        progress=False,
    )
    n = m["num_samples"]
    fwd = m.get("forward_time_s")
    return {
        "accuracy": m["accuracy"],
        "tokens_per_second": m["tokens_per_second"],
        "nfe_per_sample": m["nfe_per_sample"],
        "tokens_per_step": m["tokens_per_step"],
        "positions_per_token": m["positions_per_token"],
        "attended_per_token": m["attended_per_token"],
        "latency_s": m["generation_time_s"] / max(1, n),
        "outside_forward": None if fwd is None else 1 - fwd / m["generation_time_s"],
        "generated_tokens": m["generated_tokens"],
        "num_samples": n,
        "kv_cache_bytes": m.get("kv_cache_bytes", 0),
    }


def add_aup(rows: list[dict]) -> None:
    """Each row's AUP (`evaluation.aup`, d3LLM's accuracy under parallelism): of the curve from its
    group's baseline (one token per step) to the row, tokens per forward against accuracy, y_max the
    group's best accuracy. The baseline's own is its one point, rho_1 y_1."""
    for r in rows:
        group = [g for g in rows if g["group"] == r["group"]]
        base = next(b for b in group if b["name"].startswith("baseline"))
        y_max = 100 * max(g["accuracy"] for g in group)
        if r is base:
            r["aup"] = aup([base["tokens_per_step"]], [100 * base["accuracy"]], max(y_max, 1e-9))
            continue
        rho = [base["tokens_per_step"], r["tokens_per_step"]]
        r["aup"] = aup(rho, [100 * base["accuracy"], 100 * r["accuracy"]], max(y_max, 1e-9))


def fmt_row(r: dict) -> str:
    outside = "" if r.get("outside_forward") is None else f"{100 * r['outside_forward']:.1f}%"
    return (
        f"| {r['group']} | {r['name']} | {100 * r['accuracy']:.1f} | {r['tokens_per_second']:.1f} | "
        f"{r['speedup']:.1f}x | {r['nfe_per_sample']:.1f} | {r['tokens_per_step']:.2f} | {r.get('aup', 0.0):.1f} | "
        f"{r['positions_per_token']:.1f} | {r['attended_per_token']:.0f} | {r['latency_s']:.2f} | {outside} | "
        f"{r.get('kv_cache_bytes', 0) / 2**20:.2f} |"
    )


HEADER = (
    "| setting | configuration | accuracy % | tokens/s | speed-up | NFE/sample | tokens/step | AUP | "
    "positions/token | attended/token | latency s | outside fwd | KV cache MiB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def environment(model, device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
        "model": getattr(model, "name_or_path", None),
        "params_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        "dtype": str(model.dtype),
        "quantization": getattr(model, "quantization", None),
        **weight_bytes(model),
    }
    if str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def pareto(points: list[tuple[float, float]], higher_x_better: bool = True) -> list[int]:
    """Indices of the points no other point beats on both axes (higher accuracy, and higher x or
    lower x), ordered along x: the frontier a reader chooses on."""
    sign = 1 if higher_x_better else -1
    order = sorted(range(len(points)), key=lambda i: (-sign * points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def scatter_plot(
    path: Path,
    rows: list[dict],
    x_of,
    x_label: str,
    title: str,
    higher_x_better: bool,
    reference_line: float | None = None,
    annotate=None,
):
    """One point per row, each configuration a marker and colour named in a legend beside the
    axes (so no label sits on another), the Pareto frontier drawn through the points it keeps,
    the baseline and the default marked; returns the figure (closed by the caller)."""
    import matplotlib.pyplot as plt

    markers = "oD^vPXh<>p8d"  # the square and the star are the baseline's and the default's
    cmap = plt.get_cmap("tab20")
    labels = [f"{r['name']} ({r['group']})" for r in rows]
    # the axes keep 5.5 inches; the legend beside them gets what its longest label needs
    legend_in = 0.6 + 0.052 * max(len(t) for t in labels)
    width = 6.3 + legend_in
    fig = plt.figure(figsize=(width, 5.2))
    ax = fig.add_axes([0.75 / width, 0.11, 5.4 / width, 0.8])
    pts = [(max(x_of(r), 1e-3), 100 * r["accuracy"]) for r in rows]
    front = pareto(pts, higher_x_better)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-", color="0.55", linewidth=1.2, zorder=1)
    ax.scatter(
        [pts[i][0] for i in front],
        [pts[i][1] for i in front],
        s=260,
        facecolor="none",
        edgecolor="0.55",
        linewidth=1.2,
        zorder=2,
        label="on the Pareto frontier",
    )
    for k, (r, (x, y)) in enumerate(zip(rows, pts)):
        name = r["name"]
        special = name.startswith("baseline") or name.startswith("default")
        ax.scatter(
            x,
            y,
            s=90 if special else 45,
            marker="s"
            if name.startswith("baseline")
            else "*"
            if name.startswith("default")
            else markers[k % len(markers)],
            color=cmap(k % 20),
            edgecolor="black" if special else "none",
            linewidth=0.8,
            zorder=3,
            label=labels[k],
        )
    if annotate is not None:  # a figure beside each point (the AUP)
        for r, (x, y) in zip(rows, pts):
            ax.annotate(annotate(r), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=6.5, color="0.25")
    if reference_line is not None:
        ax.axvline(reference_line, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if reference_line is not None:  # the limit the reader compares with stays in view
        xs.append(reference_line)
    ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
    pad = max(1.0, (max(ys) - min(ys)) * 0.1)
    ax.set_ylim(min(ys) - pad, max(ys) + pad)
    ax.set_xlabel(x_label)
    ax.set_ylabel("accuracy %")
    ax.set_title(title)
    ax.grid(True, which="major", linestyle=":", linewidth=0.5)
    fig.legend(
        *ax.get_legend_handles_labels(),
        loc="center left",
        bbox_to_anchor=(6.4 / width, 0.5),
        fontsize=6.5,
        markerscale=0.7,
        frameon=False,
        handlelength=1.2,
        borderaxespad=0.0,
    )
    fig.savefig(path, dpi=130)
    return fig


def plots(out: Path, rows: list[dict], sweeps: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig = scatter_plot(
        out / "accuracy_vs_speed.png",
        rows,
        lambda r: r["tokens_per_second"],
        "tokens/s (log)",
        "accuracy vs throughput (square: baseline, star: default)",
        higher_x_better=True,
    )
    plt.close(fig)
    files.append("accuracy_vs_speed.png")
    # The same against work: positions computed per generated token (1 = the autoregressive limit).
    fig = scatter_plot(
        out / "accuracy_vs_work.png",
        rows,
        lambda r: r.get("positions_per_token") or 0.0,
        "forward positions per generated token (log; 1 = autoregressive)",
        "accuracy vs work (square: baseline, star: default)",
        higher_x_better=False,
        reference_line=1.0,
    )
    plt.close(fig)
    files.append("accuracy_vs_work.png")
    # Against parallelism, each point with its AUP (d3LLM's score, from its group's baseline)
    fig = scatter_plot(
        out / "accuracy_vs_parallelism.png",
        rows,
        lambda r: r["tokens_per_step"],
        "tokens per forward (log)",
        "accuracy vs parallelism, with each row's AUP",
        higher_x_better=True,
        annotate=lambda r: f"{r.get('aup', 0.0):.0f}",
    )
    plt.close(fig)
    files.append("accuracy_vs_parallelism.png")
    for key, label in (("threshold", "threshold"), ("block_length", "block length")):
        pts = sweeps.get(key) or []
        if not pts:
            continue
        fig, ax1 = plt.subplots(figsize=(6, 4))
        xs = [p["value"] for p in pts]
        ax1.plot(xs, [100 * p["accuracy"] for p in pts], "o-", color="tab:blue")
        ax1.set_xlabel(label)
        ax1.set_ylabel("accuracy %", color="tab:blue")
        ax2 = ax1.twinx()
        ax2.plot(xs, [p["tokens_per_second"] for p in pts], "s--", color="tab:red")
        ax2.set_ylabel("tokens/s", color="tab:red")
        if key == "block_length":
            ax1.set_xscale("log", base=2)
        ax1.set_title(
            f"{label} sweep (DualCache + threshold)" if key == "block_length" else "threshold sweep (DualCache)"
        )
        fig.tight_layout()
        name = f"sweep_{key}.png"
        fig.savefig(out / name, dpi=130)
        files.append(name)
        plt.close(fig)
    return files
