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

from ..config import GenerationConfig, is_int
from ..engine.generation import generate, warm_up
from ..engine.policies import PolicySource
from ..quant import weight_bytes
from ..text.completion import complete
from ..text.infill import encode_infill
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
    samples: Sequence[int] | None = None,
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

    limit: the first N documents; samples: the indices of the documents to evaluate instead (as
    lm-eval's `--samples`); workers: sandbox processes for code tasks; timeout: seconds per
    program (code tasks) or per equivalence check (math500); policies: the decoding policies (see
    `fastdllm.engine.policies`; default: the config's); chat_template: prompts through the
    tokenizer's chat template (default: when it has one) or, with False, as the task's plain text
    (`Question: ...\nAnswer:`). Raises ValueError (UnknownTaskError, DataError) on bad input."""
    config = config or GenerationConfig.for_model(model, checkpoint_defaults=False)
    task = get_task(task)
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size: must be a positive integer (got {batch_size!r})")
    k = task.check_num_fewshot(num_fewshot)
    docs = _documents(task, data_dir, limit, samples)
    shots = task.fewshot(k, data_dir)
    chat = has_chat_template(tokenizer) if chat_template is None else bool(chat_template)
    if chat and not has_chat_template(tokenizer):
        raise ValueError("chat_template: the tokenizer has no chat template")
    rank, world = dist_info()
    speaks = rank == 0
    if getattr(model, "tp", None):  # tensor-parallel: every rank decodes every sample with its part
        rank, world = 0, 1
    group = _object_group() if world > 1 else None

    warm_up(model, config)  # with compile: compiled now, so that the timings below exclude it
    bar = _progress(len(docs), progress and speaks, f"{task.name}")
    run = _Run(model, tokenizer, task, config, shots, chat, policies, rank)
    t_start = time.perf_counter()
    with task.scorer(workers=workers, timeout=timeout) as scorer:
        for batch in run.batches(docs[rank::world], batch_size):
            run.decode(batch, scorer)
            if bar is not None:
                bar.set_postfix(**run.postfix(), refresh=False)
                bar.update(len(batch) * world)  # the other ranks advance at about the same pace
    if bar is not None:
        bar.n = bar.total
        bar.close()

    all_records = sorted(_gather(run.records, group, world), key=lambda r: r["index"])
    timings = _gather([run.timing(time.perf_counter() - t_start)], group, world)
    results = summarize(all_records, timings)
    results.update(_settings(model, task, k, limit, samples, chat, batch_size, world, config, data_dir, model_name))
    results.update(task.result_fields(results, timeout))
    results["samples"] = all_records
    if log_samples is not None and speaks:
        write_samples(all_records, log_samples)
    return results


def _settings(model, task, k, limit, samples, chat, batch_size, world, config, data_dir, model_name) -> dict:
    """What the results were measured with: task, model, prompt, batching, config, memory, data."""
    return {
        "task": task.name,
        "description": task.description,
        "model": model_name or getattr(model, "name_or_path", None),
        "num_fewshot": k,
        "limit": limit,
        "sample_indices": None if samples is None else sorted(set(samples)),
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


def parse_indices(text: str) -> list[int]:
    """Document indices from "0-99,150" (ranges inclusive)."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"samples: {part.strip()!r} is not an index or a range like 0-99") from None
        if a < 0 or b < a:
            raise ValueError(f"samples: {part.strip()!r} is not an index >= 0 or an increasing range")
        out.extend(range(a, b + 1))
    return out


def _documents(task: Task, data_dir, limit: int | None, samples: Sequence[int] | None) -> list:
    if samples is None:
        return task.load(data_dir, limit)
    if limit is not None:
        raise ValueError("samples: give it or limit, not both")
    wanted = set(samples)
    if not wanted or not all(is_int(i) and i >= 0 for i in wanted):
        raise ValueError(f"samples: must be non-empty document indices >= 0 (got {list(samples)[:5]!r})")
    docs = [d for d in task.load(data_dir, None) if d.index in wanted]
    missing = wanted - {d.index for d in docs}
    if missing:
        raise ValueError(f"samples: {task.name} has no documents {sorted(missing)[:5]} (it has {len(docs)} asked for)")
    return docs


class _Run:
    """One rank's share of an evaluation: its documents decoded in batches, scored, and recorded."""

    def __init__(self, model, tokenizer, task: Task, config: GenerationConfig, shots, chat, policies, rank: int):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.config = encode_infill(config, tokenizer, model.mask_token_id)
        self.shots, self.chat, self.policies, self.rank = shots, chat, policies, rank
        self.stops = task.stop_strings(chat)
        self.stop_ids = list(getattr(model, "stop_token_ids", None) or tokenizer.stop_token_ids())
        self.seed = config.seed if config.seed is not None else 0
        self.records: list[dict] = []
        self.gen_time = self.score_time = self.forward_time = 0.0
        self.n_tokens = self.n_correct = self.kv_bytes = 0
        self.prompts: dict[int, list[int]] = {}

    def batches(self, docs: list, size: int):
        self.prompts = {d.index: self.task.encode(self.tokenizer, d, self.shots, self.chat) for d in docs}
        # Longest prompts first: batches of similar length waste less padding.
        order = sorted(docs, key=lambda d: (-len(self.prompts[d.index]), d.index))
        for i in range(0, len(order), size):
            yield order[i : i + size]

    def decode(self, batch: list, scorer) -> None:
        ids = [self.prompts[d.index] for d in batch]
        seeds = [self.seed + d.index for d in batch]
        try:
            out = generate(self.model, ids, config=self.config, row_seeds=seeds, policies=self.policies)
        except ValueError as e:
            raise ValueError(f"{batch[0].id}: {e}") from None
        self.gen_time += out.wall_time
        self.forward_time += out.forward_time
        self.kv_bytes = max(self.kv_bytes, out.kv_cache_bytes)
        completions = [
            complete(self.tokenizer, out.sequences[i], self.stop_ids, self.stops, self.config.fixed_end)
            for i in range(len(batch))
        ]
        t0 = time.perf_counter()
        scores = scorer.score(batch, [c.text for c in completions])
        self.score_time += time.perf_counter() - t0
        for i, (doc, comp, sc) in enumerate(zip(batch, completions, scores)):
            self.records.append(self.record(doc, comp, sc, out, i, len(batch)))
            self.n_tokens += comp.num_tokens
            self.n_correct += bool(sc.correct)

    def record(self, doc, comp, sc, out, i: int, batch_size: int) -> dict:
        steps = out.tokens_per_step[i]
        return {
            "index": doc.index,
            "id": doc.id,
            "prompt": self.task.render(self.tokenizer, doc, self.shots, self.chat),
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
            "time_s": round(out.wall_time / batch_size, 5),
            "rank": self.rank,
        }

    def postfix(self) -> dict:
        n = max(1, len(self.records))
        return {"acc": f"{self.n_correct / n:.3f}", "tok_s": f"{self.n_tokens / max(self.gen_time, 1e-9):.1f}"}

    def timing(self, total: float) -> dict:
        return {
            "rank": self.rank,
            "generation_time_s": self.gen_time,
            "forward_time_s": self.forward_time,
            "scoring_time_s": self.score_time,
            "total_time_s": total,
            "kv_cache_bytes": self.kv_bytes,
        }


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
