"""`fastdllm eval`: accuracy, tokens/s and work of a model on a benchmark (`fastdllm.evaluation.harness`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..evaluation.harness import DEFAULT_BATCH_SIZE, dist_info, evaluate, parse_indices
from ..evaluation.tasks import DataError, UnknownTaskError, get_task, list_tasks


def write_results(results: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {k: v for k, v in results.items() if k != "samples"}
    path.write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def memory_line(r: dict) -> str:
    """Weights resident (and the linear layers' share) and the largest KV cache, in MiB."""
    mib = 2**20
    q = r.get("quantization")
    kind = f"{q['bits'][0]}-bit linear layers" if q else "linear layers"
    return (
        f"weights {r.get('weight_bytes', 0) / mib:.2f} MiB ({kind} {r.get('linear_weight_bytes', 0) / mib:.2f}), "
        f"KV cache {r.get('kv_cache_bytes', 0) / mib:.2f} MiB"
    )


def format_summary(results: dict) -> str:
    r = results
    label = "pass@1" if "pass@1" in r else "accuracy"
    lines = [
        f"task {r['task']}: {r['num_samples']} samples, {r['num_fewshot']}-shot, model {r['model']}",
        f"  {label:<17} {r['accuracy']:.4f} ({r['correct']}/{r['num_samples']})",
        f"  tokens/s          {r['tokens_per_second']:.1f} (generation only; {r['generated_tokens']} tokens in "
        f"{r['generation_time_s']:.2f}s)",
        f"  NFE/sample        {r['nfe_per_sample']:.2f}",
        f"  positions/token   {r.get('positions_per_token', 0.0):.1f} computed "
        f"({r.get('decode_positions_per_token', 0.0):.2f} after one prefill of the prompt), "
        f"{r.get('attended_per_token', 0.0):.0f} attended",
        f"  tokens/step       {r['tokens_per_step']:.2f}",
        f"  memory            {memory_line(r)}",
        "  verdicts          " + ", ".join(f"{k} {v}" for k, v in sorted(r["verdicts"].items())),
    ]
    if r.get("world_size", 1) > 1:
        lines.append(
            f"  ranks             {r['world_size']} (aggregate {r['aggregate_tokens_per_second']:.1f} tokens/s)"
        )
    if "sandbox_protections" in r:
        lines.append(f"  sandbox           {', '.join(r['sandbox_protections'])}")
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .args import add_generation_args, add_model_args

    p = argparse.ArgumentParser(
        prog="fastdllm eval",
        description="Accuracy and tokens/s of a diffusion LM on a benchmark "
        "(see `python -m pydoc fastdllm.evaluation.harness`).",
        epilog="examples:\n  fastdllm eval --task arith --limit 200\n"
        "  fastdllm eval --task gsm8k --model GSAI-ML/LLaDA-8B-Instruct --num-fewshot 8 --output gsm8k.json\n"
        "  torchrun --nproc_per_node 2 -m fastdllm eval --task humaneval --model ... --log-samples he.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", required=True, help=f"one of {', '.join(list_tasks())}")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N samples only")
    p.add_argument(
        "--samples",
        default=None,
        help="evaluate these document indices instead of the first N (e.g. 0-99,150; as lm-eval's --samples)",
    )
    p.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="exemplars in the prompt (default: the task's: gsm8k 5, math500 4, mbpp 3, others 0)",
    )
    p.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="prompts decoded together (default %(default)s)"
    )
    p.add_argument("--output", default=None, help="write the results (metrics, settings) to this JSON file")
    p.add_argument("--log-samples", default=None, help="write one JSON line per sample to this file")
    p.add_argument(
        "--data-dir", default=None, help="read the task's data files from here (default: the bundled copies)"
    )
    p.add_argument(
        "--workers", type=int, default=2, help="sandbox processes for humaneval / mbpp (default %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="CPU seconds per program (code tasks, default 10) or wall seconds per MATH check (default 5)",
    )
    p.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        default=None,
        help="send each prompt as plain text (`Question: ...\\nAnswer:`), not through the model's chat template",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (it is shown when stderr is a terminal)",
    )
    add_model_args(p)
    add_generation_args(p)
    return p


def _init_distributed(args) -> bool:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    wants_cuda = torch.cuda.is_available() and (args.device is None or str(args.device).startswith("cuda"))
    if wants_cuda:
        if args.device in (None, "cuda"):
            args.device = f"cuda:{local_rank}"
        torch.cuda.set_device(torch.device(args.device))
    dist.init_process_group(backend="nccl" if wants_cuda else "gloo")
    return True


def main(argv: list[str] | None = None) -> int:
    from .args import UserError, config_from_args, load_model_or_exit, with_model_defaults

    args = build_parser().parse_args(argv)
    try:
        task = get_task(args.task)
        task.check_num_fewshot(args.num_fewshot)
    except ValueError as e:
        raise UserError(str(e)) from None
    for name in ("limit", "batch_size", "workers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be a positive integer (got {value})")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout: must be > 0 (got {args.timeout})")
    try:
        samples = None if args.samples is None else parse_indices(args.samples)
    except ValueError as e:
        raise UserError(str(e)) from None
    if samples is not None and args.limit is not None:
        raise UserError("--samples: give it or --limit, not both")
    config = config_from_args(args)
    # Check the data before loading the model: a missing file is reported at once.
    try:
        task.load(args.data_dir, args.limit)
        task.fewshot(task.check_num_fewshot(args.num_fewshot), args.data_dir)
    except (DataError, ValueError) as e:
        raise UserError(str(e)) from None

    started = _init_distributed(args)
    try:
        rank, world = dist_info()
        model, tokenizer = load_model_or_exit(args, tensor_parallel=True)
        config = with_model_defaults(args, config, model)
        try:
            results = evaluate(
                model,
                tokenizer,
                task,
                limit=args.limit,
                samples=samples,
                num_fewshot=args.num_fewshot,
                config=config,
                batch_size=args.batch_size,
                data_dir=args.data_dir,
                workers=args.workers,
                timeout=args.timeout,
                log_samples=args.log_samples,
                progress=args.progress and sys.stderr.isatty(),
                model_name=args.model or getattr(model, "name_or_path", None),
                chat_template=args.chat_template,
            )
        except (UnknownTaskError, DataError) as e:
            raise UserError(str(e)) from None
        except ValueError as e:
            raise UserError(str(e)) from None
        if rank == 0:
            if args.output:
                write_results(results, args.output)
            print(format_summary(results))
            if args.output:
                print(f"results: {args.output}")
            if args.log_samples:
                print(f"samples: {args.log_samples}")
    except BaseException:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
        raise
    if started:
        _finish_distributed()
    return 0


def _finish_distributed() -> None:
    """Tear down a torchrun worker after a successful evaluation, and exit."""
    import torch.distributed as dist

    # Together: rank 0 writes files after the gather, so the ranks reach this point at different times.
    dist.barrier()
    dist.destroy_process_group()
    # Then skip interpreter finalisation: even after this clean teardown, a C++ thread (not ours) is
    # now and then destroyed while joinable at exit, and the rank aborts with "terminate called without
    # an active exception" after its results were written (about 1 run in 10 on a loaded 2-core
    # machine; a bare gloo all_gather/barrier/destroy script did not show it in 30 runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
