"""Continuous batching: rows join a running batch at any step and decode as they would alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.engine.generation import answer_logprobs
from fastdllm.engine.rows import join_key
from fastdllm.evaluation.tasks import arith
from fastdllm.evaluation.tasks.arith import prompt_ids
from fastdllm.server.scheduler import BlockFinal, JobEnded, JobFailed


# LLaDA's rows in the default suite; Dream's (shifted logits) too in the slow set
@pytest.fixture(scope="module", params=["llada-arith", pytest.param("dream-arith", marks=pytest.mark.slow)])
def fp32(request):
    model, tok = fastdllm.load(request.param, device="cpu", dtype=torch.float32)
    return model, tok


def questions(tok, n, shots=0):
    pool = arith.fewshot_pool()
    return [prompt_ids(tok, p.question, pool[: shots + i % 2]) for i, p in enumerate(arith.test_split()[:n])]


def config_for(base: GenerationConfig, gen_length: int) -> GenerationConfig:
    """`base` for another answer length, with as many steps per block."""
    steps = None if base.steps is None else base.steps_per_block()[0] * gen_length // base.block_length
    return base.replace(gen_length=gen_length, steps=steps)


def run_with_joins(model, arrivals, base: GenerationConfig, seeds):
    """`arrivals`: {step: [(prompt, gen_length)]}; every row decoded by one BlockDecoder, later rows
    added while the earlier ones run (in the middle of their blocks). Returns each row's answer,
    in arrival order."""
    decoder = BlockDecoder(model, base)
    rows, step = [], 0
    while decoder.active or any(k >= step for k in arrivals):
        for prompt, gen in arrivals.get(step, []):
            cfg = config_for(base, gen)
            rows += decoder.add([prompt], row_seeds=[seeds[len(rows)]], config=cfg)
        if decoder.active:
            decoder.step()
        step += 1
    return rows


CONFIGS = {
    "fast-dllm": GenerationConfig.fast_dllm().replace(block_length=16, stop_at_eos=False),
    "prefix": GenerationConfig(block_length=16, threshold=0.9, cache="prefix", stop_at_eos=False),
    "no-cache-schedule": GenerationConfig(block_length=16, steps=128, threshold=None, cache="none", stop_at_eos=False),
    "vicinity": GenerationConfig(
        block_length=16,
        threshold=0.9,
        cache="dual",
        suffix_window=16,
        refresh="vicinity",
        refresh_every=3,
        stop_at_eos=False,
    ),
    "adaptive": GenerationConfig(
        block_length=16,
        threshold=0.9,
        cache="dual",
        suffix_window=16,
        refresh="adaptive",
        refresh_tol=0.02,
        stop_at_eos=False,
    ),
    "sampled-stop": GenerationConfig(block_length=16, threshold=0.9, cache="dual", temperature=0.7),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("no-cache-schedule", "vicinity", "prefix") else n
        for n in CONFIGS
    ],
)
def test_rows_that_join_decode_as_alone(fp32, name):
    """A long row runs; a short one joins at step 1 and one with a longer prompt (the running rows
    move right) at step 3, in the middle of the others' blocks: every answer is token-identical to
    the row decoded alone (float32)."""
    model, tok = fp32
    ps = questions(tok, 3)
    long_prompt = prompt_ids(tok, arith.test_split()[5].question, arith.fewshot_pool()[:2])
    assert len(long_prompt) > max(len(p) for p in ps) + 32
    base = CONFIGS[name]
    arrivals = {0: [(ps[0], 96), (ps[1], 64)], 1: [(ps[2], 32)], 3: [(long_prompt, 48)]}
    seeds = [11, 12, 13, 14]
    rows = run_with_joins(model, arrivals, base, seeds)
    alone = [(p, g) for k in sorted(arrivals) for p, g in arrivals[k]]
    for r, (p, g), seed in zip(rows, alone, seeds):
        ref = generate(model, [p], config_for(base, g).replace(seed=seed))
        assert torch.equal(r.answer, ref.sequences[0]), (name, g)
        assert r.nfe == ref.nfe_per_row[0] and r.tokens_per_step == ref.tokens_per_step[0]
        assert torch.equal(r.unmask_step, ref.unmask_step[0])


def test_join_key_and_accepts():
    base = GenerationConfig(threshold=0.9)
    assert join_key(base) == join_key(base.replace(gen_length=64))  # only the length differs
    assert join_key(base) == join_key(base.replace(block_length=16))  # each row its own blocks
    assert join_key(base) != join_key(base.replace(cache="prefix"))  # the forwards differ
    assert join_key(base) == join_key(base.replace(threshold=0.8, temperature=0.7, stop_at_eos=False))
    sched = GenerationConfig(gen_length=64, block_length=32, steps=64, threshold=None)  # 32 steps per block
    assert join_key(sched) == join_key(sched.replace(gen_length=128, steps=128))
    assert join_key(sched) == join_key(sched.replace(gen_length=128, steps=64))  # each row keeps its own schedule


def test_rows_that_cannot_join_are_refused(tiny_llada, tiny_llada2, tokenizer):
    decoder = BlockDecoder(tiny_llada, GenerationConfig(gen_length=64, block_length=32, threshold=0.9))
    decoder.add([tokenizer.encode("Hi")])
    assert decoder.accepts(GenerationConfig(gen_length=64, block_length=16, threshold=0.9))
    with pytest.raises(ValueError, match="config"):
        decoder.add([tokenizer.encode("Hi")], config=GenerationConfig(gen_length=64, cache="prefix", threshold=0.9))
    # A block-causal model's prompt K/V depend on the block: its rows agree on the block length.
    block_causal = BlockDecoder(tiny_llada2, GenerationConfig(gen_length=64, block_length=32, threshold=0.9))
    assert not block_causal.accepts(GenerationConfig(gen_length=64, block_length=16, threshold=0.9))
    # So does the sub-block cache, which finds every row's sub-blocks at once.
    sub = GenerationConfig(gen_length=64, block_length=32, cache="sub-block", sub_block_length=8)
    assert not BlockDecoder(tiny_llada, sub).accepts(sub.replace(block_length=16))
    # Uneven steps per block (3 steps over 2 blocks): every row follows its own schedule, so rows
    # join whenever they come.
    uneven = GenerationConfig(gen_length=64, block_length=32, steps=3, threshold=None)
    d = BlockDecoder(tiny_llada, uneven)
    d.add([tokenizer.encode("Hi")])
    d.step()
    assert d.accepts(uneven) and d.accepts(uneven.replace(gen_length=32, steps=5))


def test_rows_with_their_own_settings_share_forwards(fp32):
    """Rows whose thresholds, rules, temperatures and stop rules differ decode in one batch, each as
    alone (the same tokens, forwards and steps), and share the forwards."""
    model, tok = fp32
    ps = questions(tok, 4)
    base = GenerationConfig(gen_length=64, block_length=16, stop_at_eos=False)
    configs = [
        base.replace(threshold=0.5),
        base.replace(threshold=0.99, stop_at_eos=True),
        base.replace(threshold=None, steps=32),
        base.replace(threshold=0.9, temperature=0.8, seed=5),
    ]
    decoder = BlockDecoder(model, base)
    rows = [decoder.add([p], config=c)[0] for p, c in zip(ps, configs)]
    while decoder.active:
        decoder.step()
    for r, p, c in zip(rows, ps, configs):
        alone = generate(model, [p], config=c)
        assert torch.equal(r.answer, alone.sequences[0]), c
        assert r.nfe == alone.nfe_per_row[0] and r.tokens_per_step == alone.tokens_per_step[0]
    assert len({tuple(r.tokens_per_step) for r in rows}) > 1  # the settings really differ
    assert decoder.nfe < sum(r.nfe for r in rows) and decoder.row_forwards == sum(r.nfe for r in rows)


def test_rows_of_other_block_lengths_share_forwards(fp32):
    """Rows decoding in blocks of 8, 16 and 32 decode in one batch, each as alone (tokens, steps,
    forwards, log-probabilities), through the prefix and dual caches."""
    model, tok = fp32
    ps = questions(tok, 3)
    for cache in ("dual", "prefix"):
        base = GenerationConfig(gen_length=64, block_length=16, threshold=0.9, cache=cache, stop_at_eos=False)
        configs = [
            base.replace(logprobs=2),
            base.replace(block_length=32, threshold=0.8),
            base.replace(block_length=8, steps=32, logprobs=1),
        ]
        decoder = BlockDecoder(model, base)
        rows = [decoder.add([p], config=c)[0] for p, c in zip(ps, configs)]
        while decoder.active:
            decoder.step()
        reported = answer_logprobs(rows)
        for k, (r, p, c) in enumerate(zip(rows, ps, configs)):
            alone = generate(model, [p], config=c)
            assert torch.equal(r.answer, alone.sequences[0]), (cache, c.block_length)
            assert r.nfe == alone.nfe_per_row[0] and r.tokens_per_step == alone.tokens_per_step[0]
            if c.logprobs is not None:
                assert reported["logprobs"][k] == alone.logprobs[0]
                assert reported["top_logprobs"][k] == alone.top_logprobs[0]
        assert decoder.nfe < sum(r.nfe for r in rows)


def test_dropped_rows_leave_and_the_others_continue(fp32):
    model, tok = fp32
    ps = questions(tok, 2)
    base = GenerationConfig.fast_dllm().replace(gen_length=64, block_length=16, stop_at_eos=False)
    decoder = BlockDecoder(model, base)
    a, b = decoder.add(ps, row_seeds=[0, 1])
    decoder.step()
    decoder.drop([a])
    while decoder.active:
        decoder.step()
    assert not a.done and b.done
    assert torch.equal(b.answer, generate(model, [ps[1]], base).sequences[0])


# ---- the server's scheduler ------------------------------------------------------------------------
def _collect(job, timeout=120):
    async def run():
        items = []
        while True:
            item = await asyncio.wait_for(job.events.get(), timeout)
            items.append(item)
            if isinstance(item, (JobEnded, JobFailed)):
                return items

    return run()


@pytest.mark.parametrize("continuous", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_short_request_joins_a_long_one(fp32, continuous):
    """A long job decodes slowly; a short one arrives after its first block. With continuous batching
    the short one joins and ends first, and both answers are as alone; without, it waits."""
    from fastdllm.server import Job, Scheduler

    model, tok = fp32
    ps = questions(tok, 2)
    base = GenerationConfig.fast_dllm().replace(block_length=16, stop_at_eos=False, seed=None)
    order: list[str] = []
    first_block = threading.Event()

    def slow(b):
        first_block.set()
        time.sleep(0.05)

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(model, max_batch_size=4, block_hook=slow, continuous=continuous)
        long_job = Job([ps[0]], [7], base.replace(gen_length=128), loop)
        short_job = Job([ps[1]], [8], base.replace(gen_length=32), loop)
        sched.submit(long_job)
        await asyncio.to_thread(first_block.wait, 60)
        sched.submit(short_job)

        async def track(name, job):
            items = await _collect(job)
            order.append(name)
            return items

        got = await asyncio.gather(track("long", long_job), track("short", short_job))
        stats = sched.snapshot()
        sched.close()
        return got, stats

    (long_items, short_items), stats = asyncio.run(scenario())
    assert order == (["short", "long"] if continuous else ["long", "short"])
    assert stats["joined"] == (1 if continuous else 0)
    for items, prompt, gen, seed in ((long_items, ps[0], 128, 7), (short_items, ps[1], 32, 8)):
        assert items[-1] == JobEnded()
        ids = [t for item in items if isinstance(item, BlockFinal) for t in item.tokens[0]]
        ref = generate(model, [prompt], base.replace(gen_length=gen, seed=seed))
        assert ids == ref.sequences[0].tolist()


def _a_culprit_joins(model, monkeypatch, good_prompt, culprit_prompt, base, ref, constraints=None):
    """A forward fails whenever the culprit's row is in the batch; the culprit joins a running job
    (given `constraints`) after its first block. Returns the good job's items, the culprit's, and
    the scheduler's stats."""
    from fastdllm.server import Job, Scheduler

    # A token in neither the good prompt nor its answer marks the culprit's row.
    mark = next(
        t
        for t in range(100, model.args.vocab_size)
        if t not in good_prompt + ref.sequences[0].tolist() and t not in model.stop_token_ids
    )
    real = model.packed_logits

    def flaky(x, *a, **kw):
        if bool((x == mark).any()):
            raise RuntimeError("the kernel failed")
        return real(x, *a, **kw)

    monkeypatch.setattr(model, "packed_logits", flaky)
    first_block = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(model, max_batch_size=4, block_hook=lambda b: first_block.set())
        good = Job([good_prompt], [1], base.replace(gen_length=64), loop, constraints=constraints)
        bad = Job([[mark] + culprit_prompt], [2], base.replace(gen_length=32), loop)
        sched.submit(good)
        await asyncio.to_thread(first_block.wait, 60)
        sched.submit(bad)
        got = await asyncio.gather(_collect(good), _collect(bad))
        stats = sched.snapshot()
        sched.close()
        return got, stats

    (good_items, bad_items), stats = asyncio.run(scenario())
    return good_items, bad_items, stats


def test_a_failing_step_fails_only_its_culprit(fp32, monkeypatch):
    """A forward fails whenever a certain row is in the batch: that row joined a running job, so the
    batch fails after blocks were already sent. The running job is decoded again alone (no block
    sent twice) and ends as alone; only the culprit gets the error."""
    model, tok = fp32
    ps = questions(tok, 2)
    base = GenerationConfig.fast_dllm().replace(block_length=16, stop_at_eos=False, seed=None)
    ref = generate(model, [ps[0]], base.replace(gen_length=64, seed=1))
    good_items, bad_items, stats = _a_culprit_joins(model, monkeypatch, ps[0], ps[1], base, ref)
    assert isinstance(bad_items[-1], JobFailed) and stats["errors"] == 1
    assert good_items[-1] == JobEnded()
    blocks = [item.block for item in good_items if isinstance(item, BlockFinal)]
    assert blocks == [0, 1, 2, 3]  # each block once
    assert [t for item in good_items if isinstance(item, BlockFinal) for t in item.tokens[0]] == ref.sequences[
        0
    ].tolist()


def test_a_failing_batch_decodes_a_grammar_row_again_from_its_start(fp32, monkeypatch):
    """The batch fails while a JSON-constrained row is halfway through its grammar: decoded again
    alone, its grammar starts over with the answer, and it ends as it does alone."""
    from fastdllm.engine.constraints import GrammarConstraint

    model, tok = fp32
    ps = questions(tok, 2)
    base = GenerationConfig.fast_dllm().replace(block_length=16, stop_at_eos=False, seed=None)

    def grammar():
        return [GrammarConstraint.json(tok, model.stop_token_ids, budget=64)]

    ref = generate(model, [ps[0]], base.replace(gen_length=64, seed=1), constraints=grammar())
    good_items, bad_items, _ = _a_culprit_joins(model, monkeypatch, ps[0], ps[1], base, ref, grammar())
    assert isinstance(bad_items[-1], JobFailed) and good_items[-1] == JobEnded()
    tokens = [t for item in good_items if isinstance(item, BlockFinal) for t in item.tokens[0]]
    assert tokens == ref.sequences[0].tolist()
