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
from fastdllm.models.transformer import Transformer

from .conftest import random_prompts

# every family in the slow set; the default suite takes one of each attention and logit rule
FAMILIES = ["tiny_llada", "tiny_dream", "tiny_sdar", "tiny_nemotron"] + [
    pytest.param(name, marks=pytest.mark.slow) for name in ("tiny_v2", "tiny_llada2", "tiny_llada_moe")
]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_fixed_shape_step_decodes_as_the_eager_one(name, request, monkeypatch):
    """The fixed-shape step run eagerly (no compile): the same tokens, batched with padding, and a
    suffix window that hides part of the cache; with nothing seen past the block, the vicinity
    refresh's block starts and the prefix cache's steps take it too."""
    model = request.getfixturevalue(name)
    calls = []

    def eager(self):
        def run(*args):
            calls.append((args[2][0, 0].item(), args[0].shape[1]))  # the first row's window column, its width
            return self.window_logits_static(*args)

        return run

    monkeypatch.setattr(Transformer, "graphed_window_logits", eager)
    block = model.args.block_size or 8
    base = GenerationConfig(gen_length=6 * block, block_length=block, threshold=0.6, stop_at_eos=False)
    base = GenerationConfig.for_model(model, base, checkpoint_defaults=False, cache="dual", sub_block_length=None)
    vicinity = base.replace(suffix_window=0, refresh="vicinity")
    configs = [base.replace(suffix_window=None), base.replace(suffix_window=block), vicinity]
    configs += [base.replace(cache="prefix", suffix_window=0)]
    # (rows that start their blocks at one step share a fixed-shape block start: one row alone does)
    for config, lengths in [(c, (6, 11)) for c in configs] + [(vicinity, (6,))]:
        eager_out = fastdllm.generate(model, random_prompts(model, lengths), config=config)
        graphed = fastdllm.generate(model, random_prompts(model, lengths), config=config.replace(cuda_graphs=True))
        assert torch.equal(eager_out.sequences, graphed.sequences), config
        assert eager_out.nfe_per_row == graphed.nfe_per_row, config
    assert len({column for column, _ in calls}) > 1  # steps at several blocks went through it
    assert max(width for _, width in calls) >= 2 * block  # a block start: the finished block and the new one


def test_a_graphed_whole_block_step_keeps_the_sub_block_caches_logits(monkeypatch):
    """Under the sub-block cache a step whose windows are whole blocks is graphed; the columns a
    later sub-block step leaves out read its logits, as after an eager one: the same tokens."""
    model, tok = fastdllm.load("sdar-arith", dtype=torch.float32)
    calls = []

    def eager(self):
        def run(*args):
            calls.append(args[0].shape)
            return self.window_logits_static(*args)

        return run

    monkeypatch.setattr(Transformer, "graphed_window_logits", eager)
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


def test_cuda_graphs_is_checked():
    with pytest.raises(ConfigError, match="cuda_graphs"):
        GenerationConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="cuda_graphs: not with deterministic"):
        GenerationConfig(cuda_graphs=True, deterministic=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llada-arith", "sdar-arith"])
def test_compiled_once_per_layout_and_token_identical(name):
    import torch._dynamo

    model, tok = fastdllm.load(name, dtype=torch.float32)
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:3]]
    # one token a step: every row is in the middle of its block at the same steps, which the
    # fixed-shape step serves (a step where some row starts its block is an eager packed forward)
    base = GenerationConfig(gen_length=96, stop_at_eos=False, threshold=None)
    config = GenerationConfig.for_model(model, base, checkpoint_defaults=False)
    eager = fastdllm.generate(model, ids, config=config)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphed = fastdllm.generate(model, ids, config=config.replace(cuda_graphs=True))
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = fastdllm.generate(model, ids, config=config.replace(cuda_graphs=True))
    assert torch.equal(eager.sequences, graphed.sequences) and torch.equal(eager.sequences, again.sequences)
    # one per layout: a batch size, as rows leave on their own clocks; none again for the same batch
    assert 1 <= compiled <= len(ids) and torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
