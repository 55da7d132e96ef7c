"""Latency of short requests arriving behind a long one, with and without continuous batching.

One scheduler (the server's, without HTTP) on the embedded model. A long request (`--long` tokens)
starts; short requests (`--short` tokens, one block) arrive at evenly spread moments while it runs.
With continuous batching each short request joins the running batch at its next step;
without, it waits for the long one to finish. Both modes replay the same arrivals, alternating, in
one process. Reported: p50 / p95 of the short requests' latency (submit to last block), the long
request's latency, and whether every answer equals the request decoded alone.

    python benchmarks/continuous_batching.py --rounds 3 [--preset default|fast-dllm] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.evaluation.tasks import arith
from fastdllm.evaluation.tasks.arith import prompt_ids
from fastdllm.server import Job, Scheduler
from fastdllm.server.scheduler import BlockFinal, JobEnded


async def one_run(model, long_prompt, shorts, base, long_len, short_len, gaps, continuous):
    loop = asyncio.get_running_loop()
    sched = Scheduler(model, max_batch_size=8, continuous=continuous)
    t0 = time.perf_counter()
    long_job = Job([long_prompt], [0], base.replace(gen_length=long_len), loop)
    sched.submit(long_job)
    jobs, submitted = [], []

    async def drain(job):
        ids = []
        while True:
            item = await job.events.get()
            if isinstance(item, BlockFinal):
                ids += item.tokens[0]
            elif isinstance(item, JobEnded):
                return time.perf_counter(), ids
            else:
                raise RuntimeError(item)

    long_task = asyncio.create_task(drain(long_job))
    tasks = []
    for i, (p, gap) in enumerate(zip(shorts, gaps)):
        await asyncio.sleep(gap)
        job = Job([p], [i + 1], base.replace(gen_length=short_len), loop)
        submitted.append(time.perf_counter())
        sched.submit(job)
        jobs.append(job)
        tasks.append(asyncio.create_task(drain(job)))
    done = await asyncio.gather(*tasks)
    long_end, long_ids = await long_task
    stats = sched.snapshot()
    sched.close()
    return dict(
        short_latency=[end - s for (end, _), s in zip(done, submitted)],
        long_latency=long_end - t0,
        short_ids=[ids for _, ids in done],
        long_ids=long_ids,
        joined=stats["joined"],
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=1024, help="tokens of the long request")
    ap.add_argument("--short", type=int, default=32, help="tokens of each short request")
    ap.add_argument("--requests", type=int, default=12, help="short requests per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--preset", default="default", choices=["default", "fast-dllm"], help="decoding settings")
    ap.add_argument("--out", default="docs/results/continuous")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = fastdllm.load(device="cpu")
    # stop_at_eos off: the embedded model answers in ~30 tokens; the long request must be long.
    base = GenerationConfig.preset(args.preset, stop_at_eos=False, seed=None)
    pool = arith.fewshot_pool()
    long_prompt = prompt_ids(tok, arith.test_split()[0].question, pool[:8])
    shorts = [prompt_ids(tok, p.question, []) for p in arith.test_split()[1 : 1 + args.requests]]
    with torch.inference_mode():
        generate(model, [long_prompt], base.replace(gen_length=args.long, seed=0))  # warm-up
        t = time.perf_counter()
        alone_long = generate(model, [long_prompt], base.replace(gen_length=args.long, seed=0))
        long_alone_s = time.perf_counter() - t
        alone_short = [
            generate(model, [p], base.replace(gen_length=args.short, seed=i + 1)).sequences[0].tolist()
            for i, p in enumerate(shorts)
        ]
    # Arrivals spread over the first 80% of the long request's time alone.
    gaps = [0.8 * long_alone_s / args.requests] * args.requests
    results = {True: [], False: []}
    for _ in range(args.rounds):
        for mode in (False, True):
            results[mode].append(
                asyncio.run(one_run(model, long_prompt, shorts, base, args.long, args.short, gaps, mode))
            )
    rows = []
    for mode in (False, True):
        lat = [x for r in results[mode] for x in r["short_latency"]]
        same = all(
            r["long_ids"] == alone_long.sequences[0].tolist() and r["short_ids"] == alone_short for r in results[mode]
        )
        rows.append(
            dict(
                continuous=mode,
                short_p50=statistics.median(lat),
                short_p95=statistics.quantiles(lat, n=20, method="inclusive")[18],
                long_latency=statistics.median(r["long_latency"] for r in results[mode]),
                joined=statistics.median(r["joined"] for r in results[mode]),
                identical_to_alone=same,
            )
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        long=args.long,
        short=args.short,
        requests=args.requests,
        rounds=args.rounds,
        threads=args.threads,
        long_alone_s=long_alone_s,
        dtype=str(model.dtype),
        config=f"{args.preset}, stop_at_eos off",
    )
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [
        f"Preset {args.preset} (stop-at-EOS off). Long request {args.long} tokens (8-shot prompt, "
        f"{long_alone_s:.2f} s alone), {args.requests} short "
        f"requests of {args.short} tokens arriving evenly over 80% of that, {args.rounds} runs per mode, "
        f"{model.dtype}, {args.threads} thread(s).",
        "",
        "| continuous batching | short p50 (s) | short p95 (s) | long request (s) | joined | answers as alone |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'on' if r['continuous'] else 'off'} | {r['short_p50']:.3f} | {r['short_p95']:.3f} | "
            f"{r['long_latency']:.2f} | {r['joined']:.0f} | {'yes' if r['identical_to_alone'] else 'NO'} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
