"""The rows' K/V in one pool of pages of a block (`engine.kv.pages.PagedKVCache`)."""

from __future__ import annotations

import pytest
import torch

from fastdllm import GenerationConfig, generate
from fastdllm.engine.decoder import BlockDecoder
from fastdllm.engine.kv import KVRunner, runner_for
from fastdllm.engine.kv.pages import PagedKVCache

from .conftest import random_prompts, write_kv


def pool(pages=0, page_size=4, layers=2, heads=2, dim=3):
    return PagedKVCache(layers, heads, dim, page_size, pages, dtype=torch.float32, device="cpu")


def filled(cache: PagedKVCache, row: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(cache.k.shape[0], cache.k.shape[1], columns, cache.k.shape[3], generator=g)
    v = torch.randn(k.shape, generator=g)
    cache.reserve(row, columns)
    write_kv(cache, row, 0, k, v)
    return k, v


def test_rows_take_runs_of_pages_and_return_them():
    cache = pool(pages=8)
    cache.set_rows([None, None], columns=[9, 4])  # 3 pages and 1
    assert cache.tables == [[0, 1, 2], [3]] and cache.pages_in_use == 4
    assert cache.span(0, 2, 9) == slice(2, 9)  # one run: the row's keys are a view of the pool
    cache.set_rows([1])  # row 0 left: its pages are free again, row 1 is now row 0
    assert cache.tables == [[3]] and cache.free == {0, 1, 2, 4, 5, 6, 7}


def test_a_row_keeps_its_k_v_when_the_rows_are_laid_out_again():
    cache = pool(pages=6)
    cache.set_rows([None, None, None], columns=[8, 4, 8])
    kept = [filled(cache, i, n, seed=i) for i, n in enumerate([8, 4, 8])]
    cache.set_rows([2, None, 0], columns=[None, 12, None])  # row 1 left, a new row joins between
    for new, old in ((0, 2), (2, 0)):
        k, v = cache.read(new, 0, 8)
        assert torch.equal(k, kept[old][0]) and torch.equal(v, kept[old][1])


def test_a_fragmented_row_reads_its_pages_in_order():
    cache = pool(pages=6)
    cache.set_rows([None, None, None], columns=[4, 4, 4])
    cache.set_rows([None, 1, None], columns=[4, None, 4])  # frees page 0 and page 2, then retakes them
    cache.set_rows([0, 1], None)
    k, v = filled(cache, 0, 4, seed=1)
    cache.reserve(0, 12)  # the pages after its own are taken: it continues elsewhere
    more = torch.randn(2, 2, 8, 3)
    write_kv(cache, 0, 4, more, more)
    assert not isinstance(cache.span(0, 0, 12), slice)
    got, _ = cache.read(0, 0, 12)
    assert torch.equal(got[:, :, :4], k) and torch.equal(got[:, :, 4:], more)


def test_the_pool_grows_and_keeps_what_it_holds():
    cache = pool(pages=2)
    cache.set_rows([None])
    k, v = filled(cache, 0, 8, seed=3)
    cache.set_rows([0, None], columns=[None, 20])  # 5 more pages than it has
    assert cache.pages >= 7
    got, _ = cache.read(0, 0, 8)
    assert torch.equal(got, k)


def test_packed_forward_over_fragmented_pages_equals_contiguous(tiny_llada):
    """The same windows attended over a row's pages in one run and scattered: the same logits."""
    model = tiny_llada
    x = torch.tensor(random_prompts(model, [40, 40]))
    windows = [(0, 0, 40, 40, 30), (1, 0, 40, 40, 30)]
    a = model.args
    runs = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 8, 10, dtype=torch.float32, device="cpu")
    runs.set_rows([None, None], columns=[40, 40])
    scattered = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 8, 10, dtype=torch.float32, device="cpu")
    scattered.set_rows([None, None])
    scattered.tables = [[9, 0, 7, 2, 5], [1, 8, 3, 6, 4]]
    scattered.free.clear()
    want = model.packed_logits(x, windows, runs)
    got = model.packed_logits(x, windows, scattered)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    # a cached step of the last block reads every earlier column from the pages
    step = [(0, 32, 40, 40, 32), (1, 32, 40, 40, 32)]
    for w, g in zip(model.packed_logits(x, step, runs), model.packed_logits(x, step, scattered)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_rows_hold_pages_for_their_own_length(tiny_llada, cache):
    """A short row and a long one: the K/V held are their own pages, not two rows of the longest."""
    model = tiny_llada
    short, long_ = random_prompts(model, [8, 200])
    config = GenerationConfig(gen_length=32, block_length=16, cache=cache, stop_at_eos=False, prefix_cache="off")
    out = generate(model, [short, long_], config=config)
    a = model.args
    per_column = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4
    pages = sum(-(-(n + 32) // 16) for n in (8, 200))
    assert out.kv_cache_bytes == pages * 16 * per_column
    assert out.kv_cache_bytes < 2 * (200 + 32) * per_column
    for i, p in enumerate([short, long_]):  # and each row decodes as alone
        alone = generate(model, [p], config=config)
        assert torch.equal(out.sequences[i], alone.sequences[0])


# ---- chunked prefill ----------------------------------------------------------------------------
def chunked(block: int, chunk):
    return GenerationConfig(
        gen_length=2 * block, block_length=block, threshold=0.5, stop_at_eos=False, prefill_chunk=chunk
    )


@pytest.mark.parametrize("family", ["tiny_sdar", "tiny_v2", "tiny_llada2"])
def test_a_long_prompt_prefilled_in_chunks_decodes_as_in_one_forward(family, request):
    """Block-causal models: a long prompt computed a chunk per step, in the forwards of a short
    row that decodes meanwhile, gives the tokens of one prefill forward, and no forward computes
    more than the chunk besides the decoding row's window."""
    model = request.getfixturevalue(family)
    block = model.args.block_size
    short, long_ = random_prompts(model, [block, 12 * block + 1], seed=2)
    for store in ("off", "exact"):
        runner_for(model).reset_prefix_cache()
        whole = generate(model, [short, long_], config=chunked(block, None).replace(prefix_cache=store))
        runner_for(model).reset_prefix_cache()
        decoder = BlockDecoder(model, chunked(block, 2 * block).replace(prefix_cache=store))
        rows = decoder.add([short, long_])
        sizes = []
        while decoder.active:
            before = decoder.computed_positions
            decoder.step()
            sizes.append(decoder.computed_positions - before)
        for r, want in zip(rows, whole.sequences):
            assert torch.equal(r.answer, want), store
        assert rows[0].nfe == whole.nfe_per_row[0] and rows[1].nfe == whole.nfe_per_row[1]
        # the long prompt's 12 full blocks took 6 steps of 2 blocks, beside the short row's steps
        assert max(sizes[:6]) <= 2 * block + 4 * block
        # a shifted family's first forward recomputes the prompt's last column (its first logit)
        shift = int(model.args.shifted_logits)
        assert rows[1].forward_positions == whole.forward_positions[1] + shift


def test_a_bidirectional_prompt_is_not_chunked(tiny_llada):
    """LLaDA's prompt K/V depend on the answer after it: its first forward computes it whole."""
    short, long_ = random_prompts(tiny_llada, [8, 300])
    out = generate(tiny_llada, [short, long_], config=chunked(16, 32))
    alone = generate(tiny_llada, [long_], config=chunked(16, None))
    assert torch.equal(out.sequences[1], alone.sequences[0])
    assert out.nfe == max(out.nfe_per_row)  # no forward of prefill alone


def test_a_row_dropped_while_prefilled_returns_its_pages(tiny_sdar):
    block = tiny_sdar.args.block_size
    short, long_ = random_prompts(tiny_sdar, [block, 20 * block])
    decoder = BlockDecoder(tiny_sdar, chunked(block, 2 * block).replace(prefix_cache="off"))
    rows = decoder.add([short, long_])
    decoder.step()
    pool = decoder.pages.pool
    assert decoder.prefilling == [rows[1]] and pool.pending
    decoder.drop([rows[1]])
    assert not pool.pending and pool.pages_in_use == len(pool.tables[0])
    while decoder.active:
        decoder.step()
    assert rows[0].done and not rows[1].done


def test_prefill_chunk_is_validated():
    with pytest.raises(ValueError, match="prefill_chunk"):
        GenerationConfig(block_length=32, prefill_chunk=16)


def test_a_finished_decode_leaves_its_pool_to_the_next(tiny_llada):
    """The pool a decode grew is kept for the model's next decode, in or out of inference mode,
    with every page free; the tokens do not depend on it."""
    model = tiny_llada
    prompts = random_prompts(model, [30, 50])
    config = GenerationConfig(gen_length=32, block_length=16, stop_at_eos=False, prefix_cache="off")
    runner = runner_for(model)
    runner.spare = None
    first = generate(model, prompts, config=config)
    spare = runner.spare
    assert spare.pages > 0 and spare.pages_in_use == 0
    with torch.inference_mode():
        again = generate(model, prompts, config=config)
    with torch.no_grad():
        third = generate(model, prompts[:1], config=config)
    assert runner.spare is spare
    assert third.kv_cache_bytes < first.kv_cache_bytes  # its own peak, not the pool's first decode's
    assert torch.equal(first.sequences, again.sequences) and torch.equal(third.sequences[0], first.sequences[0])


def test_the_runner_owns_the_kv_and_nothing_rides_on_the_model(tiny_sdar):
    """Pages and stored prompts are the runner's: a decode given its own runner fills that runner's
    store (not the model's default one), and nothing is left on the model."""
    model = tiny_sdar
    before = dict(model.__dict__)
    prompt = list(range(10, 34))  # six blocks of 4
    config = GenerationConfig.for_model(
        model, GenerationConfig(gen_length=8, block_length=4), checkpoint_defaults=False
    )
    mine = KVRunner(model)
    runner_for(model).reset_prefix_cache()
    first = generate(model, [prompt], config, kv=mine)
    assert mine.prefix_bytes > 0 and runner_for(model).prefix_bytes == 0
    elsewhere = generate(model, [prompt], config)  # the default runner has none of it yet
    again = generate(model, [prompt], config, kv=mine)
    assert elsewhere.prompt_positions[0] == first.prompt_positions[0] > again.prompt_positions[0]
    assert torch.equal(first.sequences, again.sequences)
    assert model.__dict__.keys() == before.keys()


def test_a_runner_budget_is_one_pool_that_never_grows(tiny_llada):
    model = tiny_llada
    runner = KVRunner(model, budget_bytes=KVRunner(model).page_bytes(16) * 40)
    pool = runner.pool(16)
    assert pool.pages == 40 and not pool.growable
    runner.release(pool)
    assert runner.pool(16) is pool and runner.spare is None
    with pytest.raises(ValueError, match="budget_bytes"):
        KVRunner(model, budget_bytes=-1)


def test_a_store_over_a_pool_that_starts_empty_keeps_to_its_budget(tiny_sdar):
    """A decode's growable pool holds no page when its store is made: the store's budget still
    counts each page's bytes (it once counted 0 there, and kept every prompt)."""
    model = tiny_sdar
    page = KVRunner(model).page_bytes(4)
    runner = KVRunner(model, prefix_cache_bytes=2 * page)
    config = GenerationConfig.for_model(
        model, GenerationConfig(gen_length=8, block_length=4), checkpoint_defaults=False
    )
    generate(model, [list(range(10, 34))], config, kv=runner)  # six prompt blocks of 4
    (store,) = runner.stores()
    assert len(store.entries) == 2 and runner.prefix_bytes == 2 * page
