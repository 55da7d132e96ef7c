"""Prompt K/V shared across rows and requests (`models.prefix_store`): keyed by a hash chain of
blocks, every hit's tokens compared, least recently used evicted within a byte budget; exact and on
by default for block-causal models, an opt-in approximation for bidirectional ones."""

from __future__ import annotations

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.cache_policies import cache_policy
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.evaluation.tasks import arith
from fastdllm.models.prefix_store import PrefixStore, store_for


def kv(n: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((2, 1, n, 4), fill), torch.full((2, 1, n, 4), -fill)


def test_the_store_walks_a_hash_chain_and_compares_every_hit():
    store = PrefixStore(1 << 20, block_size=2)
    store.insert([1, 2, 3, 4, 5], 0, *kv(4, 1.0))  # two full blocks; the odd token is not kept
    assert len(store.entries) == 2 and store.match([1, 2, 3, 4, 9]) == 2 and store.match([1, 2, 9, 4]) == 1
    found = store.lookup([1, 2, 3, 4, 7, 8])
    assert len(found) == 2 and (store.hits, store.queries) == (4, 6)
    assert store.match([3, 4]) == 0  # a block's key stands for its whole prefix
    # A collision: another prompt's block filed under this prompt's key is never served.
    key = store.keys([5, 6])[0]
    store.entries[key] = store.entries[store.keys([1, 2])[0]]
    assert store.match([5, 6]) == 0 and store.lookup([5, 6]) == []


def test_the_store_evicts_the_least_recently_used_within_its_budget():
    one = kv(2, 0.0)[0].numel() * 4 * 2  # bytes of one block's K and V
    store = PrefixStore(3 * one, block_size=2)
    store.insert([1, 2, 3, 4], 0, *kv(4, 1.0))
    store.insert([7, 8], 0, *kv(2, 2.0))
    assert store.bytes == 3 * one
    store.lookup([1, 2, 3, 4])  # used again: the other prompt is now the oldest
    store.insert([5, 6], 0, *kv(2, 3.0))
    assert store.bytes <= 3 * one and store.match([7, 8]) == 0 and store.match([1, 2, 3, 4]) == 2
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixStore(-1, 2)


def fewshot(tok, n: int, shots: int) -> list[list[int]]:
    pool = arith.fewshot_pool()[:shots]
    return [arith.prompt_ids(tok, p.question, pool) for p in arith.test_split()[:n]]


@pytest.mark.parametrize("name", ["sdar-arith", "llada2-arith"])
def test_block_causal_prefixes_are_computed_once_and_decode_the_same(name):
    """4-shot prompts sharing their exemplars: on by default, token-identical to decoding without
    it, the shared blocks computed by one row of the batch, and a second batch finds them all."""
    model, tok = fastdllm.load(name, dtype=torch.float32)
    store_for(model, model.args.block_size).clear()
    ids = fewshot(tok, 6, 4)
    config = GenerationConfig.for_model(model, GenerationConfig(gen_length=32), checkpoint_defaults=False)
    assert config.prefix_cache == "exact"
    off = generate(model, ids, config.replace(prefix_cache="off"))
    on = generate(model, ids, config)
    again = generate(model, ids, config)
    assert torch.equal(off.sequences, on.sequences) and torch.equal(off.sequences, again.sequences)
    assert on.nfe_per_row == off.nfe_per_row
    shared = min(len(p) for p in ids) // 2  # most of each prompt is exemplars
    assert sum(off.forward_positions) - sum(on.forward_positions) > 4 * shared
    assert sum(again.forward_positions) < sum(on.forward_positions)
    assert all(r <= len(p) for r, p in zip(again.prompt_positions, ids))


def test_a_row_that_shares_an_uncomputed_prefix_waits_one_step(tiny_sdar):
    prompt = list(range(10, 30))
    config = GenerationConfig.for_model(
        tiny_sdar, GenerationConfig(gen_length=8, block_length=4), checkpoint_defaults=False
    )
    store_for(tiny_sdar, config.block_length).clear()
    decoder = BlockDecoder(tiny_sdar, config)
    first, second = decoder.add([prompt + [40, 41], prompt + [50, 51]])
    decoder.step()
    assert first in decoder.rows and second in decoder.joining  # it waits for the shared blocks
    decoder.step()
    assert second in decoder.rows + decoder.left and second.reused >= len(prompt) // 4 * 4


def test_bidirectional_models_share_only_when_asked(tiny_llada):
    exact = GenerationConfig(gen_length=16, block_length=8)
    assert cache_policy(tiny_llada, exact).store is None  # not exact for bidirectional attention
    assert cache_policy(tiny_llada, exact.replace(prefix_cache="approximate")).store is not None
    assert cache_policy(tiny_llada, exact.replace(cache="none", prefix_cache="approximate")).store is None
    with pytest.raises(ValueError, match="prefix_cache"):
        GenerationConfig(prefix_cache="sometimes")
