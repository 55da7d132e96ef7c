"""`fastdllm eval`: accuracy and speed on gsm8k, math500, humaneval, mbpp and arith.

    fastdllm eval --task gsm8k --model GSAI-ML/LLaDA-8B-Instruct --limit 200
    torchrun --nproc_per_node 8 -m fastdllm eval --task humaneval --model ...   # one shard per rank

    from fastdllm.evaluate import evaluate
    results = evaluate(model, tokenizer, "arith", limit=100, config=GenerationConfig(gen_length=128))

Decoding defaults are GenerationConfig's (Fast-dLLM's DualCache + threshold 0.9, gen_length 256,
blocks of 32); prompts and scoring are each task's (`fastdllm.evaluation.tasks`): GSM8K 5-shot, MATH-500
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
  them), summed over samples; decode_positions_per_token leaves out one prefill of each prompt:
  the work against the autoregressive limit of 1 position per token;
- nfe_per_sample: model forward passes a sample needed (`nfe_per_row`, what it costs alone),
  averaged over samples;
- tokens_per_step: answer positions revealed per denoising step, summed over samples and divided
  by their summed steps (1.0 for the one-token-per-step baseline);
- time_s (per sample, in the log): its batch's generation wall time divided by the batch size.

Sharding: with torch.distributed initialised (torchrun sets RANK / WORLD_SIZE; we use gloo on
CPU and NCCL on GPU), rank r takes samples r, r + W, r + 2W, ...; each sample decodes with its own
random stream (seed + sample index), and a batch decodes token-identically to single rows, so
the per-sample results do not depend on the world size or batch size. Rank 0 gathers every
sample, computes the metrics, prints and writes the files. A tensor-parallel model (`--tp`,
`models.tp`) is not sharded by sample: every rank decodes every sample with its part of the model.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import GenerationConfig
from ..engine.generation import generate, warm_up
from ..engine.policies import PolicySource
from ..quant import weight_bytes
from ..text.completion import complete
from ..version import __version__
from .tasks import Task, get_task, has_chat_template

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


def _gather(records: list[dict], group=None, world: int | None = None) -> list[dict]:
    world = dist_info()[1] if world is None else world
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
    policies: PolicySource = None,
    chat_template: bool | None = None,
) -> dict:
    """Evaluate `model` on `task`; returns the metrics (see the module docstring) with the
    per-sample records under "samples". Sharded over torch.distributed ranks when initialised
    (every rank returns the merged results; only rank 0 writes `log_samples`).

    workers: sandbox processes for code tasks; timeout: seconds per program (code tasks) or per
    equivalence check (math500); policies: the decoding policies (see `fastdllm.engine.policies`; default:
    the config's); chat_template: prompts through the tokenizer's chat template (default: when it has
    one) or, with False, as the task's plain text (`Question: ...\nAnswer:`). Raises ValueError
    (UnknownTaskError, DataError) on bad input."""
    config = config or GenerationConfig.for_model(model, checkpoint_defaults=False)
    task = get_task(task)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: must be a positive integer (got {batch_size!r})")
    k = task.check_num_fewshot(num_fewshot)
    docs = task.load(data_dir, limit)
    shots = task.fewshot(k, data_dir)
    chat = has_chat_template(tokenizer) if chat_template is None else bool(chat_template)
    if chat and not has_chat_template(tokenizer):
        raise ValueError("chat_template: the tokenizer has no chat template")
    stops = task.stop_strings(chat)
    stop_ids = list(getattr(model, "stop_token_ids", None) or tokenizer.stop_token_ids())
    rank, world = dist_info()
    speaks = rank == 0
    if getattr(model, "tp", None):  # tensor-parallel: every rank decodes every sample with its part
        rank, world = 0, 1
    group = _object_group() if world > 1 else None
    seed = config.seed if config.seed is not None else 0

    mine = docs[rank::world]
    prompts = {d.index: task.encode(tokenizer, d, shots, chat) for d in mine}
    # Longest prompts first: batches of similar length waste less padding.
    order = sorted(mine, key=lambda d: (-len(prompts[d.index]), d.index))

    warm_up(model, config)  # with compile: compiled now, so that the timings below exclude it
    bar = _progress(len(docs), progress and speaks, f"{task.name}")
    records: list[dict] = []
    gen_time = score_time = forward_time = 0.0
    n_tokens = n_correct = n_done = kv_bytes = 0
    t_start = time.perf_counter()
    with task.scorer(workers=workers, timeout=timeout) as scorer:
        for batch in _batches(order, batch_size):
            ids = [prompts[d.index] for d in batch]
            try:
                out = generate(model, ids, config=config, row_seeds=[seed + d.index for d in batch], policies=policies)
            except ValueError as e:
                raise ValueError(f"{batch[0].id}: {e}") from None
            gen_time += out.wall_time
            forward_time += out.forward_time
            kv_bytes = max(kv_bytes, out.kv_cache_bytes)
            completions = [complete(tokenizer, out.sequences[i], stop_ids, stop=stops) for i in range(len(batch))]
            t0 = time.perf_counter()
            scores = scorer.score(batch, [c.text for c in completions])
            score_time += time.perf_counter() - t0
            for i, (doc, comp, sc) in enumerate(zip(batch, completions, scores)):
                steps = out.tokens_per_step[i]
                records.append(
                    {
                        "index": doc.index,
                        "id": doc.id,
                        "prompt": task.render(tokenizer, doc, shots, chat),
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
                        "prompt_positions": int(out.prompt_positions[i]),
                        "revealed": int(sum(steps)),
                        "tokens_per_step": round(sum(steps) / len(steps), 4) if steps else 0.0,
                        "time_s": round(out.wall_time / len(batch), 5),
                        "rank": rank,
                    }
                )
                n_tokens += comp.num_tokens
                n_correct += bool(sc.correct)
            n_done += len(batch)
            if bar is not None:
                bar.set_postfix(
                    acc=f"{n_correct / n_done:.3f}", tok_s=f"{n_tokens / max(gen_time, 1e-9):.1f}", refresh=False
                )
                bar.update(len(batch) * world)  # the other ranks advance at about the same pace
    if bar is not None:
        bar.n = bar.total
        bar.close()

    timing = {
        "rank": rank,
        "generation_time_s": gen_time,
        "forward_time_s": forward_time,
        "scoring_time_s": score_time,
        "total_time_s": time.perf_counter() - t_start,
        "kv_cache_bytes": kv_bytes,
    }
    all_records = _gather(records, group, world)
    timings = _gather([timing], group, world)
    all_records.sort(key=lambda r: r["index"])
    results = summarize(all_records, timings)
    results.update(
        {
            "task": task.name,
            "description": task.description,
            "model": model_name or getattr(model, "name_or_path", None),
            "num_fewshot": k,
            "limit": limit,
            "chat_template": chat,
            "batch_size": batch_size,
            "world_size": world,
            "config": config.to_dict(),
            # memory: the weights as they sit in memory, and the largest KV cache a batch held
            **(weight_bytes(model) if hasattr(model, "named_modules") else {}),
            "quantization": getattr(model, "quantization", None),
            "data_dir": str(data_dir) if data_dir is not None else "fastdllm/evaluation/data (bundled)",
            "fastdllm_version": __version__,
        }
    )
    results.update(task.result_fields(results, timeout))
    results["samples"] = all_records
    if log_samples is not None and speaks:
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
        # the same beyond one prefill of each prompt (1 is the autoregressive limit)
        "decode_positions_per_token": (
            sum(r.get("forward_positions", 0) - r.get("prompt_positions", 0) for r in records) / tokens
            if tokens
            else 0.0
        ),
        "attended_per_token": sum(r.get("attended_positions", 0) for r in records) / tokens if tokens else 0.0,
        "tokens_per_step": sum(r["revealed"] for r in records) / steps if steps else 0.0,
        "generated_tokens": tokens,
        "mean_generated_tokens": tokens / n if n else 0.0,
        "generation_time_s": gen_time,
        # time inside the model's forward passes: 1 - forward/generation is the engine's own overhead
        "forward_time_s": sum(t.get("forward_time_s", 0.0) for t in timings),
        "scoring_time_s": sum(t["scoring_time_s"] for t in timings),
        "wall_time_s": max((t["total_time_s"] for t in timings), default=0.0),
        "kv_cache_bytes": max((t.get("kv_cache_bytes", 0) for t in timings), default=0),
        "verdicts": verdicts,
    }


def write_samples(records: Sequence[dict], path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
