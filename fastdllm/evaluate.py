"""`fastdllm eval`: accuracy and speed on gsm8k, math500, humaneval, mbpp and arith.

    fastdllm eval --task gsm8k --model GSAI-ML/LLaDA-8B-Instruct --limit 200
    torchrun --nproc_per_node 8 -m fastdllm eval --task humaneval --model ...   # one shard per rank

    from fastdllm.evaluate import evaluate
    results = evaluate(model, tokenizer, "arith", limit=100, config=GenerationConfig(gen_length=128))

Decoding defaults are GenerationConfig's (Fast-dLLM's DualCache + threshold 0.9, gen_length 256,
blocks of 32); prompts and scoring are each task's (`fastdllm.tasks`): GSM8K 5-shot, MATH-500
4-shot Minerva-style, HumanEval 0-shot, MBPP 3-shot, arith 0-shot.

Metrics (the same definitions in the results JSON, the per-sample log and the progress bar):
- generated tokens of a sample: tokens of its answer up to (not including) the first stop token
  (EOS, end-of-turn) or the task's first stop string (`text.complete(...).num_tokens`);
- accuracy: the fraction of samples scored correct (for humaneval and mbpp: pass@1, one greedy
  answer per problem, passed = its program ran to the end in the sandbox);
- tokens_per_second: generated tokens summed over all samples (and ranks), divided by the wall
  time of generation only (the sum of `GenerationOutput.wall_time` over all batches and ranks):
  prompt building, decoding to text and scoring are excluded. It is the throughput of one decoding
  process at the chosen batch size, comparable across world sizes; `aggregate_tokens_per_second`
  divides by the slowest rank's generation time instead (the throughput of the whole run);
- positions_per_token / attended_per_token: query positions computed (and query x key positions
  attended) by all of a sample's forwards, per generated token (counted as tokens/s counts
  them), summed over samples: the work against the autoregressive limit of ~1 position per token;
- nfe_per_sample: model forward passes a sample needed (`nfe_per_row`, what it costs alone),
  averaged over samples;
- tokens_per_step: answer positions revealed per denoising step, summed over samples and divided
  by their summed steps (1.0 for the one-token-per-step baseline);
- time_s (per sample, in the log): its batch's generation wall time divided by the batch size.

Sharding: with torch.distributed initialised (torchrun sets RANK / WORLD_SIZE; we use gloo on
CPU and NCCL on GPU), rank r takes samples r, r + W, r + 2W, ...; each sample decodes with its own
random stream (seed + sample index), and a batch decodes token-identically to single rows, so
the per-sample results do not depend on the world size or batch size. Rank 0 gathers every
sample, computes the metrics, prints and writes the files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import __version__
from .generate import GenerationConfig, generate
from .tasks import DataError, Task, UnknownTaskError, get_task, has_chat_template, list_tasks
from .text import complete

DEFAULT_BATCH_SIZE = 1


# ---- distributed -------------------------------------------------------------------------------
def dist_info() -> tuple[int, int]:
    """(rank, world size): from torch.distributed when initialised, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return 0, 1


def _gather(records: list[dict], group=None) -> list[dict]:
    rank, world = dist_info()
    if world == 1:
        return records
    import torch.distributed as dist

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, records, group=group)
    return [r for part in parts for r in part]


_OBJECT_GROUP = None


def _object_group():
    """A gloo group for gathering Python objects (NCCL would need them on the GPU)."""
    global _OBJECT_GROUP
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if _OBJECT_GROUP is None:
        _OBJECT_GROUP = dist.new_group(backend="gloo")
    return _OBJECT_GROUP


# ---- the evaluation ----------------------------------------------------------------------------
def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True, leave=True)


def evaluate(
    model,
    tokenizer,
    task: str | Task,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    config: GenerationConfig | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    data_dir: str | os.PathLike | None = None,
    workers: int = 2,
    timeout: float | None = None,
    log_samples: str | os.PathLike | None = None,
    progress: bool = False,
    model_name: str | None = None,
) -> dict:
    """Evaluate `model` on `task`; returns the metrics (see the module docstring) with the
    per-sample records under "samples". Sharded over torch.distributed ranks when initialised
    (every rank returns the merged results; only rank 0 writes `log_samples`).

    workers: sandbox processes for code tasks; timeout: seconds per program (code tasks) or per
    equivalence check (math500). Raises ValueError (UnknownTaskError, DataError) on bad input."""
    config = config or GenerationConfig()
    task = get_task(task)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: must be a positive integer (got {batch_size!r})")
    k = task.check_num_fewshot(num_fewshot)
    docs = task.load(data_dir, limit)
    shots = task.fewshot(k, data_dir)
    chat = has_chat_template(tokenizer)
    stops = task.stop_strings(chat)
    stop_ids = list(getattr(model, "stop_token_ids", None) or tokenizer.stop_token_ids())
    rank, world = dist_info()
    group = _object_group() if world > 1 else None
    seed = config.seed if config.seed is not None else 0

    mine = docs[rank::world]
    prompts = {d.index: task.encode(tokenizer, d, shots) for d in mine}
    # Longest prompts first: batches of similar length waste less padding.
    order = sorted(mine, key=lambda d: (-len(prompts[d.index]), d.index))

    bar = _progress(len(docs), progress and rank == 0, f"{task.name}")
    records: list[dict] = []
    gen_time = score_time = forward_time = 0.0
    n_tokens = n_correct = n_done = 0
    t_start = time.perf_counter()
    with task.scorer(workers=workers, timeout=timeout) as scorer:
        for batch in _batches(order, batch_size):
            ids = [prompts[d.index] for d in batch]
            try:
                out = generate(model, ids, config=config, row_seeds=[seed + d.index for d in batch])
            except ValueError as e:
                raise ValueError(f"{batch[0].id}: {e}") from None
            gen_time += out.wall_time
            forward_time += out.forward_time
            completions = [complete(tokenizer, out.sequences[i], stop_ids, stop=stops) for i in range(len(batch))]
            t0 = time.perf_counter()
            scores = scorer.score(batch, [c.text for c in completions])
            score_time += time.perf_counter() - t0
            for i, (doc, comp, sc) in enumerate(zip(batch, completions, scores)):
                steps = out.tokens_per_step[i]
                records.append({
                    "index": doc.index,
                    "id": doc.id,
                    "prompt": task.render(tokenizer, doc, shots),
                    "output": comp.text,
                    "extracted": sc.extracted,
                    "gold": doc.gold,
                    "verdict": sc.verdict,
                    "correct": bool(sc.correct),
                    "reason": sc.reason,
                    "finish_reason": comp.finish_reason,
                    "num_tokens": comp.num_tokens,
                    "nfe": int(out.nfe_per_row[i]),
                    "forward_positions": int(out.forward_positions[i]),
                    "attended_positions": int(out.attended_positions[i]),
                    "revealed": int(sum(steps)),
                    "tokens_per_step": round(sum(steps) / len(steps), 4) if steps else 0.0,
                    "time_s": round(out.wall_time / len(batch), 5),
                    "rank": rank,
                })
                n_tokens += comp.num_tokens
                n_correct += bool(sc.correct)
            n_done += len(batch)
            if bar is not None:
                bar.set_postfix(acc=f"{n_correct / n_done:.3f}", tok_s=f"{n_tokens / max(gen_time, 1e-9):.1f}",
                                refresh=False)
                bar.update(len(batch) * world)  # the other ranks advance at about the same pace
    if bar is not None:
        bar.n = bar.total
        bar.close()

    timing = {"rank": rank, "generation_time_s": gen_time, "forward_time_s": forward_time, "scoring_time_s": score_time,
              "total_time_s": time.perf_counter() - t_start}
    all_records = _gather(records, group)
    timings = _gather([timing], group)
    all_records.sort(key=lambda r: r["index"])
    results = summarize(all_records, timings)
    results.update({
        "task": task.name,
        "description": task.description,
        "model": model_name or getattr(model, "name_or_path", None),
        "num_fewshot": k,
        "limit": limit,
        "chat_template": chat,
        "batch_size": batch_size,
        "world_size": world,
        "config": config.to_dict(),
        "data_dir": str(data_dir) if data_dir is not None else "fastdllm/data (bundled)",
        "fastdllm_version": __version__,
    })
    if task.is_code:
        from .sandbox import protections

        results["sandbox_protections"] = list(protections())
        results["pass@1"] = results["accuracy"]
        results["timeout_s"] = timeout or task.default_timeout
    if task.name == "math500":
        from .tasks.scoring import math_backend

        results["equivalence_backend"] = math_backend()
    results["samples"] = all_records
    if log_samples is not None and rank == 0:
        write_samples(all_records, log_samples)
    return results


def summarize(records: Sequence[dict], timings: Sequence[dict] = ()) -> dict:
    """The metrics of the module docstring from per-sample records (and per-rank timings)."""
    n = len(records)
    gen_time = sum(t["generation_time_s"] for t in timings)
    slowest = max((t["generation_time_s"] for t in timings), default=0.0)
    tokens = sum(r["num_tokens"] for r in records)
    steps = sum(r["nfe"] for r in records)
    verdicts: dict[str, int] = {}
    for r in records:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    return {
        "num_samples": n,
        "correct": sum(r["correct"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / n if n else 0.0,
        "tokens_per_second": tokens / gen_time if gen_time > 0 else 0.0,
        "aggregate_tokens_per_second": tokens / slowest if slowest > 0 else 0.0,
        "nfe_per_sample": steps / n if n else 0.0,
        # work per generated token, hardware-independent (~1 position for autoregressive decoding)
        "positions_per_token": sum(r.get("forward_positions", 0) for r in records) / tokens if tokens else 0.0,
        "attended_per_token": sum(r.get("attended_positions", 0) for r in records) / tokens if tokens else 0.0,
        "tokens_per_step": sum(r["revealed"] for r in records) / steps if steps else 0.0,
        "generated_tokens": tokens,
        "mean_generated_tokens": tokens / n if n else 0.0,
        "generation_time_s": gen_time,
        # time inside the model's forward passes: 1 - forward/generation is the engine's own overhead
        "forward_time_s": sum(t.get("forward_time_s", 0.0) for t in timings),
        "scoring_time_s": sum(t["scoring_time_s"] for t in timings),
        "wall_time_s": max((t["total_time_s"] for t in timings), default=0.0),
        "verdicts": verdicts,
    }


def write_samples(records: Sequence[dict], path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_results(results: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {k: v for k, v in results.items() if k != "samples"}
    path.write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def format_summary(results: dict) -> str:
    r = results
    label = "pass@1" if "pass@1" in r else "accuracy"
    lines = [
        f"task {r['task']}: {r['num_samples']} samples, {r['num_fewshot']}-shot, model {r['model']}",
        f"  {label:<17} {r['accuracy']:.4f} ({r['correct']}/{r['num_samples']})",
        f"  tokens/s          {r['tokens_per_second']:.1f} (generation only; {r['generated_tokens']} tokens in "
        f"{r['generation_time_s']:.2f}s)",
        f"  NFE/sample        {r['nfe_per_sample']:.2f}",
        f"  positions/token   {r.get('positions_per_token', 0.0):.1f} computed, "
        f"{r.get('attended_per_token', 0.0):.0f} attended",
        f"  tokens/step       {r['tokens_per_step']:.2f}",
        "  verdicts          " + ", ".join(f"{k} {v}" for k, v in sorted(r["verdicts"].items())),
    ]
    if r.get("world_size", 1) > 1:
        lines.append(f"  ranks             {r['world_size']} (aggregate {r['aggregate_tokens_per_second']:.1f} tokens/s)")
    if "sandbox_protections" in r:
        lines.append(f"  sandbox           {', '.join(r['sandbox_protections'])}")
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .cli_args import add_generation_args, add_model_args

    p = argparse.ArgumentParser(
        prog="fastdllm eval",
        description="Accuracy and tokens/s of a diffusion LM on a benchmark (see `python -m pydoc fastdllm.evaluate`).",
        epilog="examples:\n  fastdllm eval --task arith --limit 200\n"
        "  fastdllm eval --task gsm8k --model GSAI-ML/LLaDA-8B-Instruct --num-fewshot 8 --output gsm8k.json\n"
        "  torchrun --nproc_per_node 2 -m fastdllm eval --task humaneval --model ... --log-samples he.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", required=True, help=f"one of {', '.join(list_tasks())}")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N samples only")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="exemplars in the prompt (default: the task's: gsm8k 5, math500 4, mbpp 3, others 0)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="prompts decoded together (default %(default)s)")
    p.add_argument("--output", default=None, help="write the results (metrics, settings) to this JSON file")
    p.add_argument("--log-samples", default=None, help="write one JSON line per sample to this file")
    p.add_argument("--data-dir", default=None, help="read the task's data files from here (default: the bundled copies)")
    p.add_argument("--workers", type=int, default=2, help="sandbox processes for humaneval / mbpp (default %(default)s)")
    p.add_argument("--timeout", type=float, default=None,
                   help="CPU seconds per program (code tasks, default 10) or wall seconds per MATH check (default 5)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is shown when stderr is a terminal)")
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
    from .cli_args import UserError, config_from_args, load_model_or_exit

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
        model, tokenizer = load_model_or_exit(args)
        try:
            results = evaluate(
                model, tokenizer, task, limit=args.limit, num_fewshot=args.num_fewshot, config=config,
                batch_size=args.batch_size, data_dir=args.data_dir, workers=args.workers, timeout=args.timeout,
                log_samples=args.log_samples, progress=args.progress and sys.stderr.isatty(),
                model_name=args.model or getattr(model, "name_or_path", None),
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
