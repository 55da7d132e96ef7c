"""What `fastdllm tune` leaves: the preset (the chosen config with its evidence), the frontier
table it prints, and the plot of accuracy against positions per token."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import PRESET_FORMAT
from ..version import __version__
from .search import Candidate, TuneResult


def frontier(cands: list[Candidate]) -> list[Candidate]:
    """The settings that no other beats in both accuracy drop and positions per token, fastest
    first; each read on the calibration problems it reached in the race (its drop is paired with
    the reference on those)."""
    done = [c for c in cands if c.interval is not None]
    points = sorted(done, key=lambda c: (c.positions_per_token(sorted(c.records)), c.interval.drop))
    out, best = [], float("inf")
    for c in points:
        if c.interval.drop < best:
            out.append(c)
            best = c.interval.drop
    return out


def preset(model, task, budget, confidence, metric, seed, result: TuneResult, held_out) -> dict:
    family = getattr(model, "family", None)
    idx = result.indices
    front = frontier(result.candidates)
    return {
        "format": PRESET_FORMAT,
        "family": family.name if family is not None else None,
        "model": getattr(model, "name_or_path", None),
        "task": task,
        "budget_points": budget,
        "confidence": confidence,
        "metric": metric,
        "seed": seed,
        "config": result.chosen.config.to_dict(),
        "chosen": result.chosen.label,
        "kept_default": result.kept_default,
        "calibration": {
            "problems": len(idx),
            "reference": result.reference.summary(idx),
            "chosen": result.chosen.summary(idx),
            "rungs": result.rungs,
            "stopped_early": result.stopped_early,
        },
        "held_out": held_out,
        "frontier": [c.summary(sorted(c.records)) for c in front],
        "settings": [{"label": c.label, "status": c.status} for c in result.candidates],
        "tuning_seconds": round(result.seconds, 1),
        "fastdllm_version": __version__,
    }


def table(report: dict) -> str:
    cal = report["calibration"]
    ref = cal["reference"]
    lines = [
        f"frontier of the race (reference on {cal['problems']} calibration problems: {100 * ref['accuracy']:.1f}%, "
        f"{ref['positions_per_token']:.2f} positions/token; budget {report['budget_points']} points):",
        "",
        "| setting | problems | accuracy % | drop (upper bound) | positions/token | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for f in report["frontier"]:
        mark = " **chosen**" if f["status"] == "chosen" else ""
        lines.append(
            f"| {f['label']}{mark} | {f['problems']} | {100 * f['accuracy']:.1f} | {100 * f['drop']:+.1f} "
            f"({100 * f['drop_upper']:+.1f}) | {f['positions_per_token']:.2f} | {f['tokens_per_second']:.1f} |"
        )
    held = report["held_out"]
    if held:
        lines += [
            "",
            f"held out ({held['problems']} problems, side by side):",
            "",
            "| setting | accuracy % | positions/token | tokens/s | NFE/sample |",
            "|---|---|---|---|---|",
        ]
        for name, r in held["rows"].items():
            lines.append(
                f"| {name} | {100 * r['accuracy']:.1f} | {r['positions_per_token']:.2f} | "
                f"{r['tokens_per_second']:.1f} | {r['nfe_per_sample']:.1f} |"
            )
        verdict = "EXCEEDS the budget" if held["exceeds_budget"] else "within the budget"
        lines += [
            "",
            f"held-out drop of the chosen setting: {100 * held['drop']:+.1f} points "
            f"(bounds {100 * held['drop_lower']:+.1f} .. {100 * held['drop_upper']:+.1f}): {verdict}",
        ]
    if cal["stopped_early"]:
        lines.append("the time budget ran out before the last rung: the choice reads fewer problems")
    if report["chosen"] == "reference":
        lines.append("no setting was certified within the budget: the preset is the reference decoding")
    if report.get("kept_default"):
        lines.append("no setting faster than the default was certified within the budget: the preset keeps the default")
    lines.append(f"chosen: {report['chosen']}  ({report['tuning_seconds']} s)")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Accuracy drop against positions per token: the frontier of the race, the chosen point and
    the budget line (the reference is at drop 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal, front = report["calibration"], report["frontier"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs = [f["positions_per_token"] for f in front]
    ax.plot(xs, [100 * f["drop"] for f in front], "o-", color="tab:blue", label="frontier")
    ref, ch = cal["reference"], cal["chosen"]
    ax.scatter([ref["positions_per_token"]], [0.0], marker="s", color="black", label="reference")
    ax.scatter([ch["positions_per_token"]], [100 * ch["drop"]], marker="*", s=200, color="tab:red", label="chosen")
    ax.axhline(report["budget_points"], color="tab:gray", linestyle="--", label="budget")
    ax.set_xscale("log")
    ax.set_xlabel("forward positions per generated token (log)")
    ax.set_ylabel("accuracy drop against the reference (points)")
    ax.set_title(f"fastdllm tune: {report['task']} ({cal['problems']} calibration problems)")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(report, png)
    return [out, png]
