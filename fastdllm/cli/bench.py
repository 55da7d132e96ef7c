"""`fastdllm bench`: Fast-dLLM's tables on your machine, side by side (`fastdllm.evaluation.bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import ConfigError, GenerationConfig
from ..evaluation.bench import (
    HEADER,
    REAL_TOKENS_PER_STEP,
    ROW_KEYS,
    Row,
    add_aup,
    calibrate_confidence,
    environment,
    fmt_row,
    plots,
    run_config,
    table_rows,
)
from .args import UserError, add_model_args, load_model_or_exit, not_block_decoding


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastdllm bench",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  fastdllm bench --quick\n"
        "  fastdllm bench --gen-length 256 1024 --limit 50 --out bench_out\n"
        "  fastdllm bench --gen-length 1024 --limit 2 --rows full --no-sweeps --no-batch-check\n"
        "  fastdllm bench --model GSAI-ML/LLaDA-8B-Instruct --task gsm8k --device cuda --limit 100",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--task", default="arith")
    p.add_argument(
        "--limit",
        type=int,
        nargs="+",
        default=None,
        help="samples per configuration, one value or one per gen length (default 32; --quick: 4)",
    )
    p.add_argument("--gen-length", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument(
        "--num-fewshot",
        type=int,
        nargs="+",
        default=None,
        help="shots per gen length (default: 0 for 256, 8 for 1024, as the paper)",
    )
    p.add_argument("--batch-size", type=int, default=1, help="batch size of the table rows (paper: 1)")
    p.add_argument("--stop-at-eos", choices=["off", "on", "both"], default="both")
    p.add_argument(
        "--rows",
        nargs="+",
        choices=ROW_KEYS,
        default=None,
        help="run only these table rows (the baseline always runs); default: all",
    )
    p.add_argument(
        "--sweeps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="threshold and block-size sweeps at the first gen length",
    )
    p.add_argument(
        "--batch-check", action=argparse.BooleanOptionalAction, default=True, help="full method at batch 1 vs batch 8"
    )
    p.add_argument("--preset", default=None, metavar="FILE", help="add a row for a preset that `fastdllm tune` wrote")
    p.add_argument(
        "--calibrate",
        nargs="?",
        type=float,
        const=REAL_TOKENS_PER_STEP,
        default=None,
        metavar="TOKENS_PER_STEP",
        help="also run every row in a calibrated view: confidences (not tokens) tempered so that the full "
        f"method reveals this many tokens per step, as a real model does (default {REAL_TOKENS_PER_STEP}: "
        "LLaDA-8B on GSM8K at gen 256)",
    )
    p.add_argument("--data-dir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 samples, gen length 64, small sweeps")
    p.add_argument("--out", default="bench_out")
    return p


def _per_gen_length(args) -> None:
    """Samples and shots per gen length into `args.limits` / `args.shots`, checked."""
    if args.quick:
        args.limit = args.limit or [4]
        args.gen_length = [64]
    limits = args.limit or [32]
    limits = limits * len(args.gen_length) if len(limits) == 1 else limits
    shots = args.num_fewshot or [0 if g <= 256 else 8 for g in args.gen_length]
    if len(shots) != len(args.gen_length):
        raise UserError("--num-fewshot: give one value per --gen-length")
    if len(limits) != len(args.gen_length):
        raise UserError("--limit: give one value, or one per --gen-length")
    args.limit, args.limits, args.shots = limits[0], limits, shots


class Bench:
    """One bench run on one loaded model: the table rows, the sweeps and the batch check."""

    def __init__(self, model, tokenizer, args):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.block_causal = bool(model.args.block_size)
        self.block_length = model.args.block_size if self.block_causal else args.block_length

    def row(self, config, num_fewshot, limit=None, batch_size=None) -> dict:
        a = self.args
        limit, batch_size = limit or a.limit, batch_size or a.batch_size
        return run_config(self.model, self.tokenizer, a.task, config, num_fewshot, limit, batch_size, a.data_dir)

    def method(self, **kw) -> GenerationConfig:
        """The full method (Fast-dLLM's; a block-diffusion model's own), with changes."""
        if self.block_causal:
            return GenerationConfig.for_model(self.model, GenerationConfig(**kw), checkpoint_defaults=False)
        return GenerationConfig.fast_dllm(block_length=self.block_length, **kw)

    def calibration(self) -> dict | None:
        """The calibrated view's confidence temperature (`--calibrate`), found on the full method."""
        if self.args.calibrate is None:
            return None
        cfg = self.method(gen_length=self.args.gen_length[0], threshold=0.9)
        t, tps = calibrate_confidence(self.model, self.tokenizer, cfg, self.args.task, self.args.calibrate)
        print(f"  calibrated view: confidence temperature {t} -> {tps:.2f} tokens/step at threshold 0.9", flush=True)
        return {"confidence_temperature": t, "tokens_per_step": tps, "target": self.args.calibrate}

    def table(self, calibration: dict | None = None) -> list[dict]:
        a, results = self.args, []
        views = [("", 1.0)] + ([(" calibrated", calibration["confidence_temperature"])] if calibration else [])
        for (view, temp), (gen_length, k, limit) in (
            (v, g) for v in views for g in zip(a.gen_length, a.shots, a.limits)
        ):
            rows = table_rows(gen_length, self.block_length, a.stop_at_eos, a.rows, model=self.model)
            for table_row in rows + self.preset_rows(rows, gen_length):
                r = self.row(table_row.config.replace(confidence_temperature=temp), k, limit=limit)
                group = f"{table_row.group}{view}, {k}-shot"
                results.append(
                    {
                        "name": table_row.name,
                        "group": group,
                        "config": table_row.config.to_dict(),
                        "num_fewshot": k,
                        **r,
                    }
                )
                print(
                    f"  {group:<22} {table_row.name:<40} acc {100 * r['accuracy']:5.1f}  "
                    f"{r['tokens_per_second']:8.1f} tok/s  NFE {r['nfe_per_sample']:.1f}",
                    flush=True,
                )
        for r in results:
            base = next(b for b in results if b["group"] == r["group"] and b["name"].startswith("baseline"))
            r["speedup"] = r["tokens_per_second"] / base["tokens_per_second"] if base["tokens_per_second"] else 0.0
        add_aup(results)
        return results

    def preset_rows(self, rows: list[Row], gen_length: int) -> list[Row]:
        """The tuned preset's row in each group of the table, at that group's gen length and stop rule."""
        if self.args.preset is None:
            return []
        family = getattr(self.model.family, "name", None)
        try:
            tuned = GenerationConfig.from_preset(self.args.preset, family=family, gen_length=gen_length)
        except ConfigError as e:
            raise UserError(f"--preset: {e.detail}") from None
        name = f"tuned preset ({Path(self.args.preset).stem})"
        groups = {(r.group, r.config.stop_at_eos) for r in rows}
        suffix = {True: " [stop@eos]", False: ""}
        return [Row(name + suffix[stop], tuned.replace(stop_at_eos=stop), group) for group, stop in sorted(groups)]

    def sweeps(self) -> dict[str, list[dict]]:
        a, g0, k0 = self.args, self.args.gen_length[0], self.args.shots[0]
        if not a.sweeps:
            return {}
        thresholds = [0.5, 0.7, 0.9, 1.0] if a.quick else [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
        out = {
            "threshold": [
                {"value": t, **self.row(self.method(gen_length=g0, threshold=t, stop_at_eos=False), k0)}
                for t in thresholds
            ]
        }
        if not self.block_causal:  # a block-diffusion model's block is its attention's
            blocks = [b for b in ([8, 32] if a.quick else [4, 8, 16, 32, 64]) if g0 % b == 0]
            out["block_length"] = [
                {
                    "value": b,
                    **self.row(GenerationConfig.fast_dllm(gen_length=g0, block_length=b, stop_at_eos=False), k0),
                }
                for b in blocks
            ]
        return out

    def batch_check(self) -> dict:
        if not self.args.batch_check:
            return {}
        cfg = self.method(gen_length=self.args.gen_length[0], stop_at_eos=False)
        k0 = self.args.shots[0]
        one, eight = self.row(cfg, k0, batch_size=1), self.row(cfg, k0, batch_size=8)
        ratio = eight["tokens_per_second"] / one["tokens_per_second"] if one["tokens_per_second"] else 0.0
        return {"batch_1": one, "batch_8": eight, "ratio": ratio}


def report(args, env: dict, results: list[dict], sweeps: dict, batch: dict, calibration: dict | None = None) -> str:
    g0, k0, q = args.gen_length[0], args.shots[0], env["quantization"]
    lines = [
        f"fastdllm bench: task {args.task}, {'/'.join(map(str, args.limits))} samples per row, batch "
        f"{args.batch_size}, device {env['device']}; weights {env['weight_bytes'] / 2**20:.2f} MiB resident "
        f"(linear layers {env['linear_weight_bytes'] / 2**20:.2f} MiB{', ' + str(q['bits'][0]) + '-bit' if q else ''})",
        "",
        HEADER,
    ] + [fmt_row(r) for r in results]
    for key, pts in sweeps.items():
        lines += ["", f"{key} sweep (gen {g0}, {k0}-shot, the full method):", ""]
        lines += [f"| {key} | accuracy % | tokens/s | NFE/sample |", "|---|---|---|---|"]
        lines += [
            f"| {p['value']} | {100 * p['accuracy']:.1f} | {p['tokens_per_second']:.1f} | {p['nfe_per_sample']:.1f} |"
            for p in pts
        ]
    if calibration:
        lines += [
            "",
            f"calibrated view: confidence temperature {calibration['confidence_temperature']} (confidences only; "
            f"tokens are the model's), {calibration['tokens_per_step']:.2f} tokens/step at threshold 0.9 "
            f"(target {calibration['target']})",
        ]
    if batch:
        lines += [
            "",
            f"batch 8 vs batch 1 (full method, gen {g0}): {batch['batch_8']['tokens_per_second']:.1f} vs "
            f"{batch['batch_1']['tokens_per_second']:.1f} tokens/s = {batch['ratio']:.1f}x",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _per_gen_length(args)
    model, tokenizer = load_model_or_exit(args, tensor_parallel=True)
    why = not_block_decoding(model)
    if why:
        raise UserError(f"--model: {why}; the rows of this table are Fast-dLLM's blocks: measure it with fastdllm eval")
    rank = getattr(model, "tp", (0, 1))[0]  # under --tp every rank measures; rank 0 writes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(model, tokenizer, args)
    # Warm-up: the first forward passes of a process pay for allocation and kernel selection.
    bench.row(bench.method(gen_length=args.gen_length[0]), args.shots[0], limit=1)
    calibration = bench.calibration()
    results, sweeps, batch = bench.table(calibration), bench.sweeps(), bench.batch_check()
    env = environment(model, model.device)
    table = report(args, env, results, sweeps, batch, calibration)
    print(table)
    if rank:
        return 0
    (out / "bench.md").write_text(table + "\n")
    plot_files = plots(out, results, sweeps)
    record = {
        "command": "fastdllm bench " + " ".join(argv if argv is not None else []),
        "settings": dict(vars(args)),
        "environment": env,
        "rows": results,
        "sweeps": sweeps,
        "batch": batch,
        "calibration": calibration,
        "plots": plot_files,
    }
    (out / "bench.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'} and {', '.join(plot_files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
