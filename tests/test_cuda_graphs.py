"""`cuda_graphs`: DualCache's cached steps with the shapes of every step of a layout (the window
attends over the whole cache buffer, the unseen keys masked, its column a tensor), so that one
captured graph replays at every block. Token-identical to the eager steps in float32."""

from __future__ import annotations

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.config import ConfigError
from fastdllm.engine.kv.runner import KVRunner
from fastdllm.evaluation.tasks import arith

from .conftest import random_prompts, run_eagerly

# every family in the slow set; the default suite takes one of each attention and logit rule
# (Nemotron's own: `test_nemotron_labs_diffusion.py` graphs its three modes)
FAMILIES = ["tiny_llada", "tiny_dream", "tiny_sdar"] + [
    pytest.param(name, marks=pytest.mark.slow) for name in ("tiny_nemotron", "tiny_v2", "tiny_llada2", "tiny_llada_moe")
]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_fixed_shape_step_decodes_as_the_eager_one(name, request, monkeypatch):
    """The fixed-shape step run eagerly (no compile) serves every step after the rows' first, of
    every cache policy whose windows are one per row: the same tokens and forwards, rows of
    different lengths and at different places in their blocks (padded windows), a suffix window
    that hides part of the cache, the prefix cache's windows to each row's end, no cache."""
    model = request.getfixturevalue(name)
    calls = run_eagerly(monkeypatch)
    block = model.args.block_size or 8
    base = GenerationConfig(gen_length=6 * block, block_length=block, threshold=0.6, stop_at_eos=False)
    base = GenerationConfig.for_model(model, base, checkpoint_defaults=False, cache="dual", sub_block_length=None)
    vicinity = base.replace(suffix_window=0, refresh="vicinity")
    configs = [base.replace(suffix_window=None), base.replace(suffix_window=block), vicinity]
    configs += [base.replace(cache="prefix", suffix_window=0), base.replace(cache="prefix", suffix_window=None)]
    configs += [base.replace(cache="none", suffix_window=None)]
    for config, lengths in [(c, (6, 11)) for c in configs] + [(vicinity, (6,))]:
        runner = KVRunner(model).record()
        eager_out = fastdllm.generate(model, random_prompts(model, lengths), config=config, kv=runner)
        before = len(calls)
        graphed = fastdllm.generate(model, random_prompts(model, lengths), config=config.replace(cuda_graphs=True))
        assert torch.equal(eager_out.sequences, graphed.sequences), config
        assert eager_out.nfe_per_row == graphed.nfe_per_row, config
        # every step inside the rows' blocks at least (a step where a row's window is far wider
        # than the others' may stay eager: `PADDING`)
        inside = [w for w in runner.history[1:] if len({hi - lo for _, lo, hi, _, _ in w}) == 1]
        assert len(calls) - before >= max(len(inside), 1), config
    assert len({args[2][0, 0].item() for args in calls}) > 1  # steps at several blocks went through it
    # a block start: the finished block and the new one
    assert max(args[0].shape[1] for args in calls) >= 2 * block


@pytest.mark.parametrize("name", ["tiny_dream", pytest.param("tiny_llada", marks=pytest.mark.slow)])
def test_multi_block_steps_and_the_delayed_cache_take_the_fixed_shape_step(name, request, monkeypatch):
    """Several blocks decoded at once (wider windows, a block joining mid-way), under DualCache and
    d3LLM's delayed cache (each row's committed prefix its own): graphed as eager."""
    model = request.getfixturevalue(name)
    calls = run_eagerly(monkeypatch)
    multi = dict(parallel_blocks=2, block_add_threshold=0.0, lookahead_threshold=1.0, decoded_token_threshold=0.0)
    base = GenerationConfig(gen_length=32, block_length=8, threshold=0.9, stop_at_eos=False, **multi)
    for cache in ("dual", "delayed"):
        config = GenerationConfig.for_model(model, base, checkpoint_defaults=False, cache=cache, suffix_window=None)
        runner = KVRunner(model).record()
        eager_out = fastdllm.generate(model, random_prompts(model, (5, 9)), config=config, kv=runner)
        before = len(calls)
        graphed = fastdllm.generate(model, random_prompts(model, (5, 9)), config=config.replace(cuda_graphs=True))
        assert torch.equal(eager_out.sequences, graphed.sequences), cache
        assert eager_out.nfe_per_row == graphed.nfe_per_row, cache
        inside = [w for w in runner.history[1:] if len({hi - lo for _, lo, hi, _, _ in w}) == 1]
        assert len(calls) - before >= max(len(inside), 1), cache


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_rows_of_other_block_lengths_take_the_fixed_shape_step(tiny_llada, cache, monkeypatch):
    """Rows decoding in blocks of 8, 16 and 32 in one batch (a bidirectional model's masks read no
    block length): graphed as eager, their steps inside blocks through the fixed shapes."""
    from fastdllm.engine.decoder import BlockDecoder

    calls = run_eagerly(monkeypatch)
    base = GenerationConfig(gen_length=64, block_length=16, threshold=0.6, cache=cache, stop_at_eos=False)
    configs = [base, base.replace(block_length=32), base.replace(block_length=8)]
    prompts = random_prompts(tiny_llada, (5, 9, 7))
    answers = []
    for graphs in (False, True):
        decoder = BlockDecoder(tiny_llada, base.replace(cuda_graphs=graphs))
        rows = [decoder.add([p], config=c.replace(cuda_graphs=graphs))[0] for p, c in zip(prompts, configs)]
        while decoder.active:
            decoder.step()
        answers.append([(r.answer.tolist(), r.nfe) for r in rows])
    assert answers[0] == answers[1]
    assert any(args[0].shape[0] >= 3 for args in calls)  # steps of the three rows together


def test_a_mask_that_reads_the_block_length_keeps_rows_of_other_lengths_eager(tiny_llada, tiny_nemotron):
    """Nemotron-Labs-Diffusion's fixed-shape mask reads the rows' block length: a step of rows in
    blocks of 8 and 16 is no fixed form there, and is one for LLaDA, whose masks read none."""
    from fastdllm.engine.cache.base import SequenceView
    from fastdllm.engine.kv.runner import FixedForm

    seq = SequenceView(torch.zeros(2, 64, dtype=torch.long), (16, 16), (32, 32), (1, 1), (8, 16), (8, 16))
    windows = [(0, 16, 24, 32, 16), (1, 16, 32, 32, 16)]
    assert FixedForm.of(tiny_llada, seq, windows) is not None
    assert FixedForm.of(tiny_nemotron, seq, windows) is None
    same = SequenceView(seq.x, (16, 16), (32, 32), (1, 1), (16, 16), (16, 16))
    assert FixedForm.of(tiny_nemotron, same, [(0, 16, 32, 32, 16), (1, 16, 32, 32, 16)]) is not None


def test_the_fixed_form_pads_windows_rows_and_keys_to_buckets(tiny_llada):
    """Windows of one width stay as they are; differing ones are padded to a power of two blocks,
    rows to a capture size and keys to whole buckets; a window far wider than the others' (a row
    joining a batch inside its blocks) is no fixed form: padding would more than double the step."""
    from fastdllm.engine.cache.base import SequenceView
    from fastdllm.engine.kv.pages import PagedKVCache
    from fastdllm.engine.kv.runner import FixedForm

    def seq(starts, seen, bsz):
        return SequenceView(torch.zeros(bsz, 300, dtype=torch.long), starts, seen, (1,) * bsz, (8,) * bsz, (8,) * bsz)

    steps = FixedForm.of(
        tiny_llada, seq((40, 50, 60), (72, 82, 92), 3), [(0, 40, 48, 72, 40), (1, 50, 58, 82, 50), (2, 60, 68, 92, 60)]
    )
    assert steps.width == 8 and steps.logits == [8, 8, 8]
    starts = FixedForm.of(
        tiny_llada, seq((40, 50, 60), (72, 82, 92), 3), [(0, 32, 72, 72, 40), (1, 42, 82, 82, 50), (2, 40, 92, 92, 60)]
    )
    assert starts.width == 64  # spans 40, 40, 52: four blocks of 8 would not hold them, eight do
    inputs = starts.inputs(torch.zeros(3, 300, dtype=torch.long), PagedKVCache.for_rows(tiny_llada, 3, 300), None)
    tokens, keep = inputs[0], inputs[7]
    assert tokens.shape == (4, 64) and keep.shape == (4, 8)  # 3 rows in the bucket of 4
    assert inputs[3].shape == (4, 384)  # 300 keys in whole buckets of 128
    joining = [(0, 0, 72, 72, 40), (1, 50, 58, 82, 50), (2, 60, 68, 92, 60)]
    assert FixedForm.of(tiny_llada, seq((40, 50, 60), (72, 82, 92), 3), joining) is None
    # the step in parts instead: the rows inside their blocks in one, the wide window in another
    narrow, wide = FixedForm.parts(tiny_llada, seq((40, 50, 60), (72, 82, 92), 3), joining)
    assert [w[0] for w in narrow.windows] == [1, 2] and narrow.width == 8
    assert [w[0] for w in wide.windows] == [0] and wide.width == 128  # a power of two blocks
    tokens = wide.inputs(torch.arange(900).view(3, 300), PagedKVCache.for_rows(tiny_llada, 3, 300), None)[0]
    assert tokens.shape == (1, 128) and tokens[0, 0] == 0  # row 0's tokens alone
    tokens = narrow.inputs(torch.arange(900).view(3, 300), PagedKVCache.for_rows(tiny_llada, 3, 300), None)[0]
    assert tokens.shape == (2, 8) and tokens[:, 0].tolist() == [350, 660]  # rows 1 and 2 from their windows


def test_a_graphed_whole_block_step_keeps_the_sub_block_caches_logits(monkeypatch):
    """Under the sub-block cache a step whose windows are whole blocks is graphed; the columns a
    later sub-block step leaves out read its logits, as after an eager one: the same tokens."""
    model, tok = fastdllm.load("sdar-arith", dtype=torch.float32)
    calls = run_eagerly(monkeypatch)
    logits_of, kept = KVRunner.logits, []

    def logits(self, pages, seq, policy, steps):
        before = len(calls)
        out = logits_of(self, pages, seq, policy, steps)
        if len(calls) > before:  # a graphed step: the row's latest logits are its
            kept.append(torch.equal(pages.latest, out))
        return out

    monkeypatch.setattr(KVRunner, "logits", logits)
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:4]]
    config = GenerationConfig.for_model(model, gen_length=64, cache="sub-block", sub_block_length=2)
    eager_out = fastdllm.generate(model, ids, config=config)
    graphed = fastdllm.generate(model, ids, config=config.replace(cuda_graphs=True))
    assert kept and all(kept)
    assert torch.equal(graphed.sequences, eager_out.sequences) and graphed.nfe_per_row == eager_out.nfe_per_row
    # on a fixed schedule its rows' sub-block steps part their phases (a row's block start, which
    # the full refresh computes to its end, among rows' sub-blocks): such steps run in parts, a
    # fixed-shape call each (`FixedForm.parts`)
    config = config.replace(steps=16, threshold=None, stop_at_eos=False, refresh="full", suffix_window=None)
    eager_out, before, kept[:] = fastdllm.generate(model, ids, config=config), len(calls), []
    graphed = fastdllm.generate(model, ids, config=config.replace(cuda_graphs=True))
    assert torch.equal(graphed.sequences, eager_out.sequences) and graphed.nfe_per_row == eager_out.nfe_per_row
    assert len(calls) - before > len(kept) >= max(graphed.nfe_per_row) - 1


def test_cuda_graphs_is_checked():
    with pytest.raises(ConfigError, match="cuda_graphs"):
        GenerationConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="cuda_graphs: not with deterministic"):
        GenerationConfig(cuda_graphs=True, deterministic=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_llada", "tiny_sdar"])
def test_compiled_a_few_graphs_and_token_identical(name, request):
    """Compiled (the function a GPU captures as CUDA graphs): the eager tokens; rows padded to
    their bucket and keys to whole buckets, so that a block's first step and its later ones are
    one graph each per rows' bucket, as rows leave on their own clocks, and none is compiled again."""
    import torch._dynamo

    model = request.getfixturevalue(name)
    block = model.args.block_size or 8
    base = GenerationConfig(gen_length=4 * block, block_length=block, threshold=0.6, stop_at_eos=False)
    config = GenerationConfig.for_model(model, base, checkpoint_defaults=False, cache="dual", sub_block_length=None)
    eager = fastdllm.generate(model, random_prompts(model, (6, 11, 9)), config=config)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphed = fastdllm.generate(model, random_prompts(model, (6, 11, 9)), config=config.replace(cuda_graphs=True))
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = fastdllm.generate(model, random_prompts(model, (6, 11, 9)), config=config.replace(cuda_graphs=True))
    assert torch.equal(eager.sequences, graphed.sequences) and torch.equal(eager.sequences, again.sequences)
    assert eager.nfe_per_row == graphed.nfe_per_row
    # three rows, then fewer: buckets of 4, 2 and 1 rows, two window widths each at most
    assert 1 <= compiled <= 6 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
