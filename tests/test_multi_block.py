"""Multi-block decoding (`parallel_blocks`): the blocks after the current one are decoded in the
same forwards, for every family, through the one loop; with a lookahead that reveals nothing the
decoding is the one-block loop's."""

from __future__ import annotations

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.config import ConfigError
from fastdllm.engine.decode import Lookahead
from fastdllm.engine.kv.runner import KVRunner

from .conftest import random_prompts

FAMILIES = ["tiny_llada", "tiny_dream", "tiny_llada_moe", "tiny_sdar", "tiny_v2", "tiny_llada2"]
# the later blocks take part but never reveal: confidences are never above 1, and the current
# block always has a mask at a step's start, so no later block is ever "complete"
SILENT = dict(parallel_blocks=3, block_add_threshold=0.0, lookahead_threshold=1.0, decoded_token_threshold=1.0)
# the later blocks reveal one position per step each, from the start
ONE_EACH = dict(parallel_blocks=2, block_add_threshold=0.0, lookahead_threshold=1.0, decoded_token_threshold=0.0)


def prompts(model, lengths=(5, 9), seed=0):
    return random_prompts(model, lengths, seed)


def config_for(model, **kw):
    block = model.args.block_size or 8
    base = GenerationConfig(gen_length=4 * block, block_length=block, threshold=0.5, stop_at_eos=False)
    return GenerationConfig.for_model(model, base, checkpoint_defaults=False, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_lookahead_that_reveals_nothing_decodes_as_one_block_at_a_time(name, request):
    """The wider forwards change nothing where later blocks cannot reach the current one: a
    block-causal model's attention, and a prefix cache (its windows run to the end either way)."""
    model = request.getfixturevalue(name)
    ids = prompts(model)
    cache = {} if model.args.block_size else {"cache": "prefix"}
    one = fastdllm.generate(model, ids, config=config_for(model, **cache))
    many = fastdllm.generate(model, ids, config=config_for(model, **cache, **SILENT))
    assert torch.equal(one.sequences, many.sequences)
    assert one.tokens_per_step == many.tokens_per_step and one.nfe_per_row == many.nfe_per_row


@pytest.mark.parametrize("name", FAMILIES)
def test_later_blocks_are_revealed_in_the_current_blocks_forwards(name, request):
    model = request.getfixturevalue(name)
    ids = prompts(model, lengths=(8, 16))  # whole blocks: the answer's blocks are the model's
    config = config_for(model, threshold=0.99)  # the current block: about one position per step
    one = fastdllm.generate(model, ids, config=config)
    many = fastdllm.generate(model, ids, config=config_for(model, threshold=0.99, **ONE_EACH))
    blk = config.block_length
    assert (many.sequences != model.mask_token_id).all()
    for row in range(len(ids)):
        steps, one_steps = many.unmask_step[row], one.unmask_step[row]
        # block 1 began while block 0 was still decoded; one block at a time, it waits
        assert steps[blk : 2 * blk].min() <= steps[:blk].max()
        for b in range(config.num_blocks - 1):
            assert one_steps[(b + 1) * blk : (b + 2) * blk].min() > one_steps[b * blk : (b + 1) * blk].max()
        assert steps.max() < one_steps.max() and max(many.tokens_per_step[row]) >= 2
    assert many.nfe < one.nfe


@pytest.mark.parametrize("name", ["tiny_llada", "tiny_sdar"])
def test_a_row_decodes_the_same_in_a_batch_as_alone(name, request):
    model = request.getfixturevalue(name)
    ids = prompts(model, lengths=(7, 7, 7), seed=3)
    config = config_for(model, threshold=0.99, **ONE_EACH)
    batch = fastdllm.generate(model, ids, config=config)
    for row, p in enumerate(ids):
        alone = fastdllm.generate(model, [p], config=config)
        assert torch.equal(alone.sequences[0], batch.sequences[row])
        assert alone.tokens_per_step[0] == batch.tokens_per_step[row]


def test_blocks_revealed_whole_ahead_of_time_are_refreshed_with_the_next_one(tiny_llada):
    """A block finished before it was current had no block-start forward: the vicinity refresh of
    the next block that has one starts that many blocks further back."""
    model = tiny_llada
    config = config_for(
        model,
        threshold=0.99,
        cache="dual",
        refresh="vicinity",
        suffix_window=None,
        gen_length=48,
        parallel_blocks=3,
        block_add_threshold=0.0,
        lookahead_threshold=0.0,
    )
    runner = KVRunner(model).record()
    out = fastdllm.generate(model, prompts(model, (6,)), config=config, kv=runner)
    assert (out.sequences != model.mask_token_id).all()
    blk = config.block_length
    # the vicinity refreshes: from before the block (a step's window starts at it, a full one at 0)
    starts = [(lo, start) for windows in runner.history for _, lo, _, _, start in windows if 0 < lo < start]
    # block 0's first step reveals blocks 1 and 2 whole; block 3 is the next to have a forward
    assert starts and all(start - lo == 3 * blk for lo, start in starts), starts


def test_the_lookahead_rule():
    rule = Lookahead(depth=3, add=0.5, activate=0.75, threshold=0.9)
    current = torch.tensor([[True, True, False, False]])  # half revealed: block 1 takes part
    masked = torch.tensor([[True, True, True, True, True, True, True, True]])
    conf = torch.tensor([[0.95, 0.2, 0.3, 0.1, 0.99, 0.99, 0.99, 0.99]])
    # block 1: only its confident position (not yet complete: 0.5 < 0.75); block 2: block 1 has
    # nothing revealed yet, so it waits however confident it is
    assert rule.select(conf, masked, current, None).tolist() == [[True, False, False, False] + [False] * 4]
    current = torch.tensor([[False, False, False, True]])  # three quarters: block 1 is complete
    conf = torch.tensor([[0.5, 0.2, 0.7, 0.1, 0.99, 0.99, 0.99, 0.99]])
    assert rule.select(conf, masked, current, None).tolist() == [[False, False, True, False] + [False] * 4]
    masked = torch.tensor([[False, False, False, True, True, True, True, True]])  # block 1: 3/4 revealed
    assert rule.select(conf, masked, current, None).tolist() == [[False, False, False, True] + [True] * 4]


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(parallel_blocks=0), "parallel_blocks"),
        (dict(parallel_blocks=1.5), "parallel_blocks"),
        (dict(parallel_blocks=2, sub_block_length=8), "parallel_blocks"),
        (dict(parallel_blocks=2, cache="sub-block", sub_block_length=8), "parallel_blocks"),
        (dict(lookahead_threshold=1.5), "lookahead_threshold"),
        (dict(block_add_threshold=-0.1), "block_add_threshold"),
        (dict(decoded_token_threshold="high"), "decoded_token_threshold"),
    ],
)
def test_bad_settings_name_their_field(kw, param):
    with pytest.raises(ConfigError) as e:
        GenerationConfig(**kw)
    assert e.value.param == param and param in str(e.value)


def test_published_settings_decode_one_block_at_a_time():
    assert GenerationConfig().parallel_blocks == 1
    assert GenerationConfig.fast_dllm(parallel_blocks=3).parallel_blocks == 3
    assert GenerationConfig.replace(GenerationConfig(parallel_blocks=3), cache="none").parallel_blocks == 3
    assert GenerationConfig.baseline().parallel_blocks == 1 and GenerationConfig.fast_dllm().parallel_blocks == 1


def _windows(model, ids, config):
    runner = KVRunner(model).record()
    out = fastdllm.generate(model, ids, config=config, kv=runner)
    return out, runner.history


def test_a_delayed_cache_that_never_commits_decodes_as_no_cache(tiny_llada):
    """d3LLM's delayed cache: while a finished block waits to be committed every forward is full,
    so with a delay no decode reaches it decodes as no cache at all, forward for forward."""
    ids = prompts(tiny_llada)
    plain, _ = _windows(tiny_llada, ids, config_for(tiny_llada, threshold=0.99, cache="none", **ONE_EACH))
    never = config_for(tiny_llada, threshold=0.99, cache="delayed", cache_delay=10**6, **ONE_EACH)
    delayed, delayed_windows = _windows(tiny_llada, ids, never)
    assert torch.equal(plain.sequences, delayed.sequences) and plain.nfe_per_row == delayed.nfe_per_row
    assert all(lo == 0 for forward in delayed_windows for _, lo, _, _, _ in forward)


@pytest.mark.parametrize("delay, interval", [(0, None), (1, None), (2, 3)])
def test_a_delayed_cache_recomputes_from_its_committed_prefix(tiny_llada, delay, interval):
    """After its first forward a row's forwards start at its committed prefix's end, a block
    boundary that only moves forward, except the full ones: while a block waits out its delay, and
    every `refresh_interval`-th forward."""
    ids = prompts(tiny_llada, lengths=(6,))
    config = config_for(
        tiny_llada, threshold=0.99, cache="delayed", cache_delay=delay, refresh_interval=interval, **ONE_EACH
    )
    out, windows = _windows(tiny_llada, ids, config)
    blk, prompt = config.block_length, len(ids[0])
    starts = [forward[0][1] for forward in windows]
    assert starts[0] == 0 and len(starts) == out.nfe
    partial = [s for s in starts if s > 0]
    assert partial and partial == sorted(partial) and all((s - prompt) % blk == 0 for s in partial)
    full_after_first = starts[1:].count(0)
    if delay == 0 and interval is None:
        assert full_after_first == 0  # a finished block is committed by the next forward
    else:
        assert full_after_first > 0
    if interval:
        assert all(starts[n - 1] == 0 for n in range(interval, out.nfe + 1, interval))


def test_a_delayed_cache_row_decodes_the_same_in_a_batch_as_alone(tiny_llada):
    ids = prompts(tiny_llada, lengths=(5, 9, 7), seed=4)
    config = config_for(tiny_llada, threshold=0.99, cache="delayed", cache_delay=1, **ONE_EACH)
    batch = fastdllm.generate(tiny_llada, ids, config=config)
    for row, p in enumerate(ids):
        alone = fastdllm.generate(tiny_llada, [p], config=config)
        assert torch.equal(alone.sequences[0], batch.sequences[row])
        assert alone.nfe_per_row[0] == batch.nfe_per_row[row]
