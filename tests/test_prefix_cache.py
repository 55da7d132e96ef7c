"""Prompt K/V shared across rows and requests (`engine.kv.prefix`): keyed by a hash chain of
blocks, every hit's tokens compared, least recently used evicted within a byte budget; exact and on
by default for block-causal models, an opt-in approximation for bidirectional ones."""

from __future__ import annotations

import gc
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.engine.kv import KVRunner, runner_for
from fastdllm.engine.kv.pages import PagedKVCache
from fastdllm.engine.kv.prefix import PrefixStore
from fastdllm.evaluation.tasks import arith

from .conftest import write_kv


def pool(pages=8, page_size=2):
    return PagedKVCache(2, 1, 4, page_size, pages, dtype=torch.float32, device="cpu")


def stored_row(cache: PagedKVCache, tokens: list[int], store: PrefixStore) -> int:
    """A row that computed `tokens` (its K/V filled with its tokens), stored, then left."""
    row = len(cache.tables)
    cache.set_rows(list(range(row)) + [None], columns=[None] * row + [len(tokens)])
    cols = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(2, 1, -1, 4)
    write_kv(cache, row, 0, cols, -cols)
    store.insert(tokens, 0, cache.tables[row][: len(tokens) // cache.page_size])
    cache.set_rows(list(range(row)))
    return row


def test_the_store_walks_a_hash_chain_and_compares_every_hit():
    cache = pool()
    store = PrefixStore(cache, 1 << 20)
    stored_row(cache, [1, 2, 3, 4, 5], store)  # two full blocks; the odd token is not kept
    assert len(store.entries) == 2 and store.match([1, 2, 3, 4, 9]) == 2 and store.match([1, 2, 9, 4]) == 1
    found = store.lookup([1, 2, 3, 4, 7, 8])
    assert len(found) == 2 and (store.lookups.hits, store.lookups.queries) == (4, 6)
    assert store.match([3, 4]) == 0  # a block's key stands for its whole prefix
    # A collision: another prompt's block filed under this prompt's key is never served.
    key = store.keys([5, 6])[0]
    store.entries[key] = store.entries[store.keys([1, 2])[0]]
    assert store.match([5, 6]) == 0 and store.lookup([5, 6]) == []


def test_the_store_evicts_the_least_recently_used_within_its_budget():
    cache = pool()
    store = PrefixStore(cache, 3 * cache.page_bytes)
    stored_row(cache, [1, 2, 3, 4], store)
    stored_row(cache, [7, 8], store)
    assert store.bytes == 3 * cache.page_bytes and cache.pages_in_use == 0  # cached, not in use
    assert cache.cached_pages == 3
    store.lookup([1, 2, 3, 4])  # used again: the other prompt is now the oldest
    stored_row(cache, [5, 6], store)
    assert store.bytes <= 3 * cache.page_bytes and store.match([7, 8]) == 0 and store.match([1, 2, 3, 4]) == 2
    assert len(cache.free) == cache.pages - 3  # the evicted block's page is free again
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixStore(cache, -1)


def test_a_hit_is_shared_by_reference_and_copied_before_a_write():
    """The row that finds a stored prefix holds the store's pages; writing into one gives the row
    its own copy, and the store's page keeps what it held."""
    cache = pool()
    store = PrefixStore(cache, 1 << 20)
    stored_row(cache, [1, 2, 3, 4], store)
    cache.set_rows([None], columns=[6])
    pages = store.lookup([1, 2, 3, 4, 9, 9])
    cache.share(0, pages)
    assert cache.tables[0][:2] == pages and all(cache.refs[p] == 2 for p in pages)
    assert cache.pages_in_use == 3 and cache.cached_pages == 0  # the two shared pages and the row's own
    want = cache.read(0, 0, 4)[0].clone()
    write_kv(cache, 0, 2, torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4))
    assert cache.tables[0][0] == pages[0] and cache.tables[0][1] != pages[1]
    assert torch.equal(cache.k[:, :, pages[1] * 2 : pages[1] * 2 + 2], want[:, :, 2:])  # the store's page unchanged
    assert torch.equal(cache.read(0, 0, 2)[0], want[:, :, :2])


def test_a_pool_let_go_is_freed_with_its_store():
    """The store refers to its pool weakly: a server's pool replaced (or a model's dropped) frees
    its memory at once, not at the next garbage collection."""
    cache = pool()
    PrefixStore(cache, 1 << 20)
    gone = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert gone() is None
    finally:
        gc.enable()


def test_a_full_pool_evicts_what_only_the_store_holds():
    cache = PagedKVCache(2, 1, 4, 2, 4, dtype=torch.float32, device="cpu", growable=False)
    store = PrefixStore(cache, 1 << 20)
    stored_row(cache, [1, 2, 3, 4], store)
    cache.set_rows([None], columns=[2])
    cache.share(0, store.lookup([1, 2]))  # the first block is held by a row, the second is not
    cache.set_rows([0, None], columns=[None, 6])  # 3 pages: 1 free, 1 the store's alone, ...
    assert store.match([1, 2]) == 1 and len(store.entries) == 1 and cache.cached_pages == 0
    with pytest.raises(RuntimeError, match="pool is full"):
        cache.set_rows([0, 1, None], columns=[None, None, 2])


def fewshot(tok, n: int, shots: int) -> list[list[int]]:
    pool = arith.fewshot_pool()[:shots]
    return [arith.prompt_ids(tok, p.question, pool) for p in arith.test_split()[:n]]


@pytest.mark.parametrize("name", ["sdar-arith", pytest.param("llada2-arith", marks=pytest.mark.slow)])
def test_block_causal_prefixes_are_computed_once_and_decode_the_same(name):
    """4-shot prompts sharing their exemplars: on by default, token-identical to decoding without
    it, the shared blocks computed by one row of the batch, and a second batch finds them all."""
    model, tok = fastdllm.load(name, dtype=torch.float32)
    runner_for(model).reset_prefix_cache()
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
    # the rows hold the stored exemplar blocks by reference: once, not once per row
    assert again.kv_cache_bytes <= on.kv_cache_bytes < off.kv_cache_bytes / 2
    pool = runner_for(model).spare  # the decodes are done: every stored page is cached, none in use
    assert pool.cached_pages == len(pool.stored) == len(pool.prefix.entries) > 0 and pool.pages_in_use == 0


def test_a_row_that_shares_an_uncomputed_prefix_waits_one_step(tiny_sdar):
    prompt = list(range(10, 30))
    config = GenerationConfig.for_model(
        tiny_sdar, GenerationConfig(gen_length=8, block_length=4), checkpoint_defaults=False
    )
    runner_for(tiny_sdar).reset_prefix_cache()
    decoder = BlockDecoder(tiny_sdar, config)
    first, second = decoder.add([prompt + [40, 41], prompt + [50, 51]])
    decoder.step()
    assert first in decoder.rows and second in decoder.joining  # it waits for the shared blocks
    decoder.step()
    assert second in decoder.rows + decoder.left and second.reused >= len(prompt) // 4 * 4


def test_bidirectional_models_share_only_when_asked(tiny_llada):
    exact = GenerationConfig(gen_length=16, block_length=8)
    assert BlockDecoder(tiny_llada, exact).pages.store is None  # not exact for bidirectional attention
    assert BlockDecoder(tiny_llada, exact.replace(prefix_cache="approximate")).pages.store is not None
    assert BlockDecoder(tiny_llada, exact.replace(cache="none", prefix_cache="approximate")).pages.store is None
    with pytest.raises(ValueError, match="prefix_cache"):
        GenerationConfig(prefix_cache="sometimes")


def test_a_row_that_rewrites_a_shared_page_copies_it_first(tiny_llada):
    """LLaDA with approximate sharing and full refreshes: a later block's refresh recomputes the
    prompt (its K/V now see the decoded answer). Rows write into copies; the stored pages keep
    what they held, so other answers after the same prefix do not change them."""
    model = tiny_llada
    runner_for(model).reset_prefix_cache()
    shared = list(range(5, 37))
    config = GenerationConfig(
        gen_length=16, block_length=8, cache="dual", refresh="full", prefix_cache="approximate", stop_at_eos=False
    )
    first = generate(model, [shared + [40 + i, 50 + i] for i in range(3)], config)
    (store,) = [s for s in runner_for(model).stores() if s.entries]
    columns = [e.page * 8 + c for e in store.entries.values() for c in range(8)]
    held = store.pool.k[:, :, columns].clone()
    others = [shared + [60 + i, 70 + i, 80 + i] for i in range(3)]
    second = generate(model, others, config)
    assert sum(second.prompt_positions) < sum(first.prompt_positions)  # the prefix was shared
    assert torch.equal(store.pool.k[:, :, columns], held)
    assert torch.equal(generate(model, others, config).sequences, second.sequences)


@pytest.mark.parametrize("cache", ["prefix", "dual", "delayed"])
@pytest.mark.parametrize("name", ["tiny_llada", "tiny_sdar"])
def test_every_cache_policy_fills_the_store(request, name, cache):
    """Whatever the policy, the rows' prompts are stored after their first forward: a second
    request with the same prompt computes none of its stored blocks again."""
    model = request.getfixturevalue(name)
    runner_for(model).reset_prefix_cache()
    prompt = list(range(10, 34))  # six blocks of 4
    config = GenerationConfig.for_model(
        model,
        GenerationConfig(gen_length=8, block_length=4, cache=cache, prefix_cache="approximate", stop_at_eos=False),
        checkpoint_defaults=False,
    )
    first = generate(model, [prompt], config)
    second = generate(model, [prompt], config)
    assert first.prompt_positions[0] == len(prompt)
    assert second.prompt_positions[0] < len(prompt) // 2
    if model.args.block_size:  # exact: the same answer
        assert torch.equal(first.sequences, second.sequences)


def test_a_policy_object_keeps_the_configs_engine_settings(tiny_sdar):
    """A cache policy passed as an object decodes under the config's page size, determinism and
    prefix sharing, exactly as the one the config names."""
    from fastdllm.engine.cache import DualCache
    from fastdllm.engine.policies import Policies, resolve

    config = GenerationConfig.for_model(
        tiny_sdar,
        GenerationConfig(gen_length=8, block_length=4, deterministic=True),
        checkpoint_defaults=False,
    )
    named = resolve(None, tiny_sdar, config)
    given = resolve(Policies(cache=DualCache(tiny_sdar)), tiny_sdar, config).cache
    whole = resolve(Policies(DualCache(tiny_sdar), named.strategy), tiny_sdar, config).cache
    for policy in (named.cache, given, whole):
        pages = BlockDecoder(tiny_sdar, config, policies=Policies(cache=policy)).pages
        assert pages.page_size == 4 and pages.shares and pages.batch_invariant
    runner_for(tiny_sdar).reset_prefix_cache()
    prompt = list(range(10, 34))
    generate(tiny_sdar, [prompt], config)
    again = generate(tiny_sdar, [prompt], config, policies=Policies(cache=DualCache(tiny_sdar)))
    assert again.prompt_positions[0] < len(prompt) // 2


def test_a_tight_kv_budget_runs_more_rows_when_prompts_share_a_prefix():
    """The server's admission counts a prompt block that rows share by reference once: under a
    budget that two rows' own pages fill, 4-shot requests sharing their exemplars run several at a
    time, each answered as without sharing, and the pool never holds more than the budget."""
    from fastdllm.server.scheduler import Job

    from .test_server import LiveServer

    model, tok = fastdllm.load("sdar-arith", dtype=torch.float32)
    prompts = fewshot(tok, 6, 4)
    defaults = GenerationConfig.for_model(model, GenerationConfig(gen_length=32), checkpoint_defaults=False)
    token = KVRunner(model).page_bytes(1)
    own = max(Job([p], [0], defaults, None).pages() for p in prompts) * defaults.block_length * token
    budget = int(2.5 * own)
    seen = {}
    for sharing in ("exact", "off"):
        runner_for(model).reset_prefix_cache()
        server = LiveServer(
            model, tok, defaults=defaults.replace(prefix_cache=sharing), kv_cache_bytes=budget, max_batch_size=8
        )
        try:
            server.scheduler.pause()
            bodies = [{"model": "llada-arith", "prompt": p, "max_tokens": 32, "temperature": 0} for p in prompts]
            with ThreadPoolExecutor(len(bodies)) as pool:
                asked = [pool.submit(server.post, "/v1/completions", b) for b in bodies]
                time.sleep(0.3)
                server.scheduler.resume()
                answers = [a.result() for a in asked]
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
            kv_pool = server.scheduler.kv.budget_pool
            assert kv_pool.peak_pages * kv_pool.page_bytes <= budget
            seen[sharing] = (
                server.scheduler.snapshot()["max_batch_rows"],
                [r.json()["choices"][0]["text"] for r in answers],
            )
        finally:
            server.stop()
    assert seen["off"][0] <= 2 < seen["exact"][0]
    assert seen["exact"][1] == seen["off"][1]
