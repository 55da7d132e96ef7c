"""One attention call per layer for every row of a packed forward (`models.packed`) against a call
per row: the same logits within float rounding for every family's attention rule (bidirectional,
block-causal, WeDLM's masks-after-tokens order, Nemotron's two passes), rows of different widths
and key counts; the same tokens through the loop; and batch invariance keeping a call per row."""

from __future__ import annotations

import pytest
import torch

import fastdllm
from fastdllm.models.packed import PackedRows, one_call

from .test_tp import FAMILIES  # every family's tiny model, as tensor parallelism checks them


@pytest.fixture(scope="module")
def tiny_wedlm(tokenizer):  # the one of them conftest does not make
    from tests.test_reference import wedlm_model

    return wedlm_model(tokenizer, "qwen2.5")


@pytest.mark.parametrize("name", FAMILIES)
def test_one_call_gives_each_rows_logits(name, request, tokenizer):
    model = request.getfixturevalue(name)
    config = fastdllm.GenerationConfig.for_model(
        model, fastdllm.GenerationConfig(gen_length=16, block_length=8, threshold=0.5, stop_at_eos=False, seed=0)
    )
    prompts = [tokenizer.encode(t) for t in ("Question: 1 + 1", "Tom has 5 apples and buys 3 more. How many?", "Hi")]
    seen = {}
    for calls in ("per_row", "one"):
        model.attention_calls = calls
        try:
            out = fastdllm.generate(model, prompts, config=config)
        finally:
            model.attention_calls = "auto"
        seen[calls] = out.sequences
    assert torch.equal(seen["one"], seen["per_row"]), name


def test_windows_of_every_shape_attend_alike(tiny_sdar, tiny_llada):
    """Packed windows of different widths and keys (a block-causal model's block starts and
    steps, prompts whose keys run past others'): logits within 1e-5 either way."""
    from fastdllm.engine.kv.pages import PagedKVCache

    for model in (tiny_sdar, tiny_llada):
        x = torch.randint(5, 200, (3, 40), generator=torch.Generator().manual_seed(0))
        windows = [(0, 0, 24, 24, 16), (1, 0, 40, 40, 32), (2, 0, 12, 12, 4)]
        out = {}
        for calls in ("per_row", "one"):
            model.attention_calls = calls
            cache = PagedKVCache.for_rows(model, 3, 40)
            try:
                with torch.no_grad():
                    first = model.packed_logits(x, windows, cache)
                    later = model.packed_logits(x, [(0, 16, 24, 24, 16), (2, 8, 12, 12, 8)], cache)
            finally:
                model.attention_calls = "auto"
            out[calls] = first + later
        for a, b in zip(out["one"], out["per_row"]):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_batch_invariance_keeps_a_call_per_row():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not one_call("one", cuda, 16, batch_invariant=True, cpu_too=True)
    assert one_call("one", cpu, 2, batch_invariant=False, cpu_too=False)
    assert not one_call("auto", cpu, 16, batch_invariant=False, cpu_too=False)
    assert one_call("auto", cuda, 8, batch_invariant=False, cpu_too=False)
    assert not one_call("auto", cuda, 4, batch_invariant=False, cpu_too=False)
    assert one_call("auto", cpu, 4, batch_invariant=False, cpu_too=True)
    with pytest.raises(ValueError, match="attention_calls: "):
        one_call("padded", cpu, 4, batch_invariant=False, cpu_too=False)


def test_padded_queries_see_a_key_and_are_dropped():
    table = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]])
    rows = PackedRows([3, 1], table, [5, 2], torch.device("cpu"))
    mask = rows.mask(None)
    assert mask.shape == (2, 1, 3, 5)
    assert mask[1, 0, 0].tolist() == [True, True, False, False, False]
    assert (mask[1, 0, 1:].sum(-1) >= 1).all()  # padding: never a row of -inf
    q = torch.randn(4, 2, 8)
    keys = torch.randn(2, 5, 2, 8)
    out = rows.attend(q, keys, keys, mask)
    assert out.shape == (4, 2, 8) and torch.isfinite(out).all()
