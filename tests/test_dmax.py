"""DMax's decoding as policies of the one loop: the left-to-right rule, self-revision, its stop
rule and the soft-embedding feedback through the model's input hook. Its step is checked against
DMax's own `decode_uniform` in tests/test_reference.py."""

from __future__ import annotations

import pytest
import torch

from fastdllm import ConfigError, GenerationConfig, generate
from fastdllm.engine.decode import BlockClock, Editing, LeftToRight
from fastdllm.engine.kv.pages import PagedKVCache
from fastdllm.models.transformer import soft_embeddings

from .conftest import random_prompts, run_eagerly


def test_left_to_right_stops_at_the_first_unsure_mask_or_takes_the_leftmost():
    rule = LeftToRight(0.5)
    conf = torch.tensor([[0.9, 0.8, 0.3, 0.95], [0.2, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])
    masked = torch.tensor([[False, True, True, True], [True, True, True, True], [True, False, True, True]])
    clock = BlockClock.uniform(masked, 4)
    chosen = rule.select(conf, masked, clock, None, None)
    assert chosen.tolist() == [
        [False, True, False, False],  # 0.3 stops it; 0.95 after it waits
        [True, False, False, False],  # the leftmost is unsure: it alone
        [True, False, True, True],  # revealed positions neither count nor stop it
    ]


def test_dmaxs_stop_rule():
    editing = Editing(0.0, 16, stop_confidence=0.9)
    mask = 9
    block = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, mask, 3]])
    region = torch.tensor([[0, 0, 1], [0, 0, 1], [-1, 0, 1], [0, -1, 1]]) >= 0  # revealed in the block
    top = torch.tensor([[0.95, 0.99, 0.91], [0.95, 0.5, 0.91], [0.1, 0.99, 0.91], [0.95, 0.99, 0.91]])
    changed = torch.tensor([True, True, True, False])
    steps = torch.tensor([2, 2, 2, 2])
    done = editing.confident_stop(block, region, top, changed, steps, mask)
    # all sure; one unsure; the unsure one is a prompt token (not masked at the block's start); masks left
    assert done.tolist() == [True, False, True, False]
    assert editing.confident_stop(block[1:2], region[1:2], top[1:2], torch.tensor([False]), steps[:1], mask).item()
    assert editing.confident_stop(block[1:2], region[1:2], top[1:2], changed[:1], torch.tensor([3]), mask).item()


def test_soft_embeddings_mix_the_token_and_the_mask_on_their_sphere():
    emb = torch.nn.Embedding(5, 4)
    top, p = torch.tensor([[2, 3]]), torch.tensor([[1.0, 0.25]])
    out = soft_embeddings(emb, top, p, mask_id=4)
    torch.testing.assert_close(out[0, 0], emb.weight[2].detach(), rtol=1e-5, atol=1e-6)  # p = 1: the token
    mixed = 0.25 * emb.weight[3] + 0.75 * emb.weight[4]
    norm = 0.25 * emb.weight[3].norm() + 0.75 * emb.weight[4].norm()
    torch.testing.assert_close(out[0, 1], (mixed * norm / (mixed.norm() + 1e-6)).detach(), rtol=1e-5, atol=1e-6)


def test_the_input_hook_replaces_only_the_columns_it_names(tiny_llada):
    model = tiny_llada
    x = torch.tensor([random_prompts(model, [10], seed=4)[0]])
    windows = [(0, 0, 10, 10, 0)]

    def logits(embeds=None):
        cache = PagedKVCache.for_rows(model, 1, 10)
        return model.packed_logits(x, windows, cache, embeds=embeds)[0]

    plain = logits()
    cols = torch.tensor([3, 7])
    same = model.tok_embeddings(x[0, cols])
    torch.testing.assert_close(logits({0: (cols, same)}), plain)
    other = logits({0: (cols, torch.zeros(2, model.args.dim))})
    assert not torch.allclose(other, plain)


def test_the_dmax_preset_and_its_fields():
    d = GenerationConfig.dmax()
    assert (d.unmasking, d.threshold, d.editing_threshold, d.stop_confidence, d.soft_embeddings) == (
        "left_to_right",
        0.5,
        0.0,
        0.9,
        True,
    )
    assert (d.cache, d.suffix_window, d.refresh, d.block_length) == ("dual", 0, "vicinity", 32)
    assert GenerationConfig.preset("dmax") == d
    for bad in (dict(stop_confidence=0.9), dict(soft_embeddings=True), dict(editing_threshold=0.0, stop_confidence=2)):
        with pytest.raises(ConfigError):
            GenerationConfig(**bad)
    with pytest.raises(ConfigError, match="^soft_embeddings: "):
        GenerationConfig.dmax(parallel_blocks=2, stop_confidence=None)


@pytest.mark.parametrize("arch", ["tiny_llada", pytest.param("tiny_llada2", marks=pytest.mark.slow)])
def test_dmax_decodes_through_the_loop_and_feeds_back_soft_embeddings(arch, request, monkeypatch):
    model = request.getfixturevalue(arch)
    prompts = random_prompts(model, [6, 9], seed=1)
    config = GenerationConfig.dmax(gen_length=16, block_length=8, deterministic=True).fit_to_model(model)
    assert config.unmasking == "left_to_right"  # the family's own rule does not replace it
    calls = []
    packed = type(model).packed_logits

    def spy(self, x, windows, cache, **kw):
        calls.append((windows, kw.get("embeds")))
        return packed(self, x, windows, cache, **kw)

    monkeypatch.setattr(type(model), "packed_logits", spy)
    out = generate(model, prompts, config=config)
    assert not (out.sequences == model.mask_token_id).any()
    blocks = 16 // config.block_length + 1  # a block-causal prompt may end inside a block: one more
    assert all(n <= blocks * config.block_length for n in out.nfe_per_row)  # at most a block's length each
    # a step after a block's first feeds its revealed positions back, inside the rows' windows
    # (the columns it does not feed back: -1)
    fed = [(w, row, c[c >= 0]) for w, e in calls if e for row, (c, _) in e.items() if (c >= 0).any()]
    assert fed and all(
        any(row == r and lo <= int(c.min()) and int(c.max()) < hi for r, lo, hi, _, _ in w) for w, row, c in fed
    )
    monkeypatch.undo()
    # rows decode as alone (batch-invariant forwards), the fed-back vectors included
    for p, seq in zip(prompts, out.sequences):
        assert torch.equal(generate(model, [p], config=config).sequences[0], seq)


def test_dmax_takes_the_fixed_shape_step_with_its_soft_embeddings(tiny_llada, monkeypatch):
    """`cuda_graphs`: the fed-back vectors ride in the fixed-shape step (eagerly here) as tensors
    at their windows' columns: the same tokens and forwards as the eager steps, which feed them
    as input vectors of the packed forward. In float64: the fed-back probabilities carry a step's
    rounding into the next, and the fixed-shape step sums over more (masked) keys."""
    import copy

    tiny_llada = copy.deepcopy(tiny_llada).double()

    calls = run_eagerly(monkeypatch)
    prompts = random_prompts(tiny_llada, [6, 9, 7], seed=2)
    config = GenerationConfig.dmax(gen_length=24, block_length=8).fit_to_model(tiny_llada)
    eager_out = generate(tiny_llada, prompts, config=config)
    graphed = generate(tiny_llada, prompts, config=config.replace(cuda_graphs=True))
    assert torch.equal(graphed.sequences, eager_out.sequences)
    assert graphed.nfe_per_row == eager_out.nfe_per_row
    assert any(args[-1] is not None and bool(args[-1][1].any()) for args in calls)  # vectors went through it
