"""`fastdllm tune`: the fastest decoding within an accuracy budget, for your model and task
(`fastdllm.tuning`)."""

from __future__ import annotations

import argparse
import re

from ..config import GenerationConfig
from ..evaluation.tasks import get_task, list_tasks
from .args import UserError, add_generation_args, add_model_args, not_block_decoding

EXAMPLES = """examples:
  fastdllm tune --task arith --budget 1 --out arith.json
  fastdllm tune --model sdar-arith --task arith --budget 2 --limit 300 --time-budget 10m --out sdar.json
  fastdllm eval --task arith --preset arith.json        # use it wherever a config goes
  fastdllm serve --presets arith.json                  # requests may send {"preset": "arith"}
"""


def seconds(text: str) -> float:
    """ "90", "90s", "10m", "1.5h" -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 10m or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def build_parser() -> argparse.ArgumentParser:
    from ..tuning.search import METRICS
    from ..tuning.tune import AGAINST

    p = argparse.ArgumentParser(
        prog="fastdllm tune",
        description="Search the decoding settings the model's family supports for the fastest one whose "
        "accuracy is at most --budget points below the family's reference decoding (one token per step, "
        "full refresh), at a stated confidence, on a calibration split; check it on held-out problems; "
        "write it as a preset.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", required=True, help=f"one of {', '.join(list_tasks())}")
    p.add_argument("--budget", type=float, default=1.0, help="accuracy points the setting may lose (default 1)")
    p.add_argument("--confidence", type=float, default=0.9, help="the budget holds at this confidence (default 0.9)")
    p.add_argument(
        "--limit", type=int, default=None, help="calibration problems (default 500, at most half the task's)"
    )
    p.add_argument(
        "--holdout", type=int, default=None, help="held-out problems for the check (default 500 or the rest; 0: none)"
    )
    p.add_argument(
        "--metric",
        choices=METRICS,
        default="positions_per_token",
        help="what 'fastest' means: work per token, tokens/s, or the AUP (d3LLM's accuracy under "
        "parallelism) of the budget's reference point and the setting's",
    )
    p.add_argument(
        "--against",
        choices=AGAINST,
        default="reference",
        help="what the budget is counted from: the family's one token per step (reference) or the "
        "defaults with the flags given (default: no worse than what you run now)",
    )
    p.add_argument(
        "--time-budget",
        type=seconds,
        default=seconds("10m"),
        help="stop racing after this long, and the held-out check after as long again (default 10m; e.g. "
        "90s, 1h): the settings decoded by then compete, the problems checked by then count",
    )
    p.add_argument("--candidates", type=int, default=16, help="random combinations beside the one-field moves")
    p.add_argument(
        "--search",
        nargs="+",
        default=None,
        metavar="FIELD",
        help="search only these fields (default: every field that declares search values and the model's "
        "family uses: " + ", ".join(GenerationConfig.search_space()) + ")",
    )
    p.add_argument(
        "--split-seed", type=int, default=0, help="draws the calibration split and the random combinations (default 0)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="problems decoded together (default 16)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", required=True, help="the preset file to write (its plot beside it, .png)")
    add_model_args(p)
    add_generation_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..tuning import report
    from ..tuning.tune import tune
    from .args import config_from_args, load_model_or_exit

    args = build_parser().parse_args(argv)
    for name in ("limit", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be a positive integer")
    if not 0 <= args.budget < 100:
        raise UserError(f"--budget: must be in [0, 100) points (got {args.budget})")
    if not 0.5 <= args.confidence < 1:
        raise UserError(f"--confidence: must be in [0.5, 1) (got {args.confidence})")
    if (args.holdout is not None and args.holdout < 0) or args.candidates < 0:
        raise UserError("--holdout and --candidates: must be >= 0")
    try:
        get_task(args.task)
    except ValueError as e:
        raise UserError(str(e)) from None
    base = config_from_args(args)
    model, tokenizer = load_model_or_exit(args)
    why = not_block_decoding(model)
    if why:
        raise UserError(
            f"--model: {why}; the knobs tune searches (cache, block length, multi-block) are block "
            "decoding's: set its own decoding fields and measure with fastdllm eval"
        )
    try:
        result = tune(
            model,
            tokenizer,
            args.task,
            base,
            budget=args.budget,
            limit=args.limit,
            holdout=args.holdout,
            confidence=args.confidence,
            metric=args.metric,
            time_budget=args.time_budget,
            random_candidates=args.candidates,
            fields=args.search,
            seed=args.split_seed,
            batch_size=args.batch_size,
            data_dir=args.data_dir,
            against=args.against,
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    result["model"] = args.model or result["model"]
    files = report.write(result, args.out)
    print(report.table(result))
    print(f"wrote {', '.join(map(str, files))}")
    return 0
