"""Block-diffusion families (SDAR / TraDo on the Qwen3 layout, Fast-dLLM v2 on Qwen2): their real
checkpoint layouts, block-causal attention checked against a forward written here from the
weights alone, the exact cache, and decoding through the one loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.kv.pages import PagedKVCache
from fastdllm.engine.kv.runner import KVRunner
from fastdllm.engine.policies import Policies
from fastdllm.models.loading import save_pretrained

FAMILIES = ["tiny_sdar", "tiny_v2"]


def reference_forward(
    folder,
    ids: torch.Tensor,
    record: list | None = None,
    stale: list | None = None,
    fresh: range | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Logits (T, V) of one unpadded sequence, from config.json and the safetensors alone: Qwen2 /
    Qwen3 blocks, RoPE by rotate-half, and the block-causal rule key block <= query block.
    `record`: each layer's (k, v) appended to it. `stale` (a `record` of another forward): every
    layer attends to those K/V except at the positions `fresh`, which use this forward's own (a
    step against a cache computed from other tokens). `block`: attention blocks other than the
    checkpoint's (a decoding block, as SDAR's evaluation builds its mask)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(str(f)))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    block = block or cfg.get("block_size") or cfg.get("bd_size")
    eps = cfg["rms_norm_eps"]
    t = ids.shape[0]
    pos = torch.arange(t)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(pos.float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(v):  # (T, H, D)
        half = v.shape[-1] // 2
        return v * cos + torch.cat([-v[..., half:], v[..., :half]], -1) * sin

    def linear(v, name):
        out = v @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    allowed = (pos[None, :] // block) <= (pos[:, None] // block)  # (query, key)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = linear(h, p + "self_attn.q_proj").view(t, heads, hd)
        k = linear(h, p + "self_attn.k_proj").view(t, kv_heads, hd)
        v = linear(h, p + "self_attn.v_proj").view(t, kv_heads, hd)
        if p + "self_attn.q_norm.weight" in w:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        if record is not None:
            record.append((k, v))
        if stale is not None:
            keep = torch.ones(t, dtype=torch.bool)
            keep[list(fresh)] = False
            k, v = torch.where(keep[:, None, None], stale[i][0], k), torch.where(keep[:, None, None], stale[i][1], v)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        att = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + linear(torch.einsum("hqk,khd->qhd", att, v).reshape(t, heads * hd), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = linear(h, p + "mlp.gate_proj"), linear(h, p + "mlp.up_proj")
        x = x + linear(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def sample_ids(model, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.args.vocab_size, (length,), generator=g)
    ids[ids == model.mask_token_id] = 0
    ids[length // 2 :: 3] = model.mask_token_id  # masked positions, as decoding has them
    return ids


@pytest.mark.parametrize("name", FAMILIES)
def test_a_real_layout_loads_and_its_logits_equal_a_block_causal_forward(name, request, tokenizer, tmp_path):
    model = request.getfixturevalue(name)
    folder = save_pretrained(model, tmp_path / name, tokenizer, dtype=torch.float32, max_shard_bytes=40_000)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == model.family.reference_config["model_type"] and "auto_map" in cfg
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # sharded, with an index
    loaded, _ = fastdllm.load(str(folder))
    assert loaded.family is model.family and loaded.args.block_size == model.args.block_size
    ids = sample_ids(model, 23)  # ends inside a block
    ours = loaded(ids[None])[0]
    ref = reference_forward(folder, ids)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_block_causal_forward_ignores_everything_after_the_querys_block(name, request):
    model = request.getfixturevalue(name)
    b = model.args.block_size
    ids = sample_ids(model, 5 * b)
    full = model(ids[None])[0]
    changed = ids.clone()
    changed[3 * b :] = (changed[3 * b :] + 7) % model.args.vocab_size
    other = model(changed[None])[0]
    assert torch.equal(full[: 3 * b], other[: 3 * b])
    assert not torch.allclose(full[3 * b :], other[3 * b :])


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_windows_equal_a_full_block_causal_forward(name, request):
    """The exact cache: the first forward fills the cache up to a block's end; a later block's
    first step recomputes the just-finished block with the current one, later steps the current
    block alone, each against the cache, and each equals a full forward of the sequence then."""
    model = request.getfixturevalue(name)
    b, shift = model.args.block_size, int(model.args.shifted_logits)
    x = sample_ids(model, 6 * b)[None].clone()
    x[0, 2 * b :] = model.mask_token_id
    cache = PagedKVCache.for_rows(model, 1, 6 * b)
    model.packed_logits(x, [(0, 0, 3 * b, 3 * b, 2 * b)], cache)
    x[0, 2 * b : 3 * b] = torch.arange(b) + 5  # block 2 decoded
    for step in range(3):
        if step:
            x[0, 3 * b + step] = 40 + step  # a token revealed in block 3
        lo = 2 * b if step == 0 else 3 * b - shift
        (got,) = model.packed_logits(x, [(0, lo, 4 * b, 4 * b, 3 * b)], cache)
        got = got[None]
        want = model(x)[:, 3 * b - shift : 4 * b - shift]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (step, (got - want).abs().max())


def test_sdar_decoding_is_the_same_with_the_exact_cache_and_without_any(tiny_sdar, tokenizer):
    prompts = [tokenizer.encode("Question: 3 + 4 = ?"), tokenizer.encode("Question: what is 12 + 30?\nAnswer:")]
    assert len({len(p) % 4 for p in prompts}) == 2  # prompts ending at different places in a block
    base = dict(gen_length=16, block_length=4, stop_at_eos=False)
    for rule in (dict(threshold=None), dict(threshold=0.3)):
        exact = GenerationConfig.for_model(tiny_sdar, GenerationConfig(**base, **rule), temperature=0.0)
        assert (exact.block_length, exact.cache, exact.suffix_window) == (4, "dual", 0)
        none = exact.replace(cache="none", suffix_window=None, refresh="full")
        a, n = generate(tiny_sdar, prompts, config=exact), generate(tiny_sdar, prompts, config=none)
        assert torch.equal(a.sequences, n.sequences) and a.nfe_per_row == n.nfe_per_row, rule
        assert a.forward_positions[0] < n.forward_positions[0]  # windows, not the whole sequence
        for i, p in enumerate(prompts):  # a row decodes in a batch as alone
            alone = generate(tiny_sdar, [p], config=exact)
            assert torch.equal(alone.sequences[0], a.sequences[i])


def test_a_prompt_ending_inside_a_block_shares_it_with_the_answer(tiny_sdar, tokenizer):
    prompt = next(
        p
        for p in (
            tokenizer.encode(t)
            for t in ("Question: 3 + 4 = ?", "Question: what is 12 + 30?\nAnswer:", "What is 5 + 6?")
        )
        if len(p) % 4
    )
    lead = len(prompt) % 4
    config = GenerationConfig.for_model(
        tiny_sdar, GenerationConfig(gen_length=8, block_length=4, threshold=None, stop_at_eos=False), temperature=0.0
    )
    out = generate(tiny_sdar, [prompt], config=config)
    assert out.sequences.shape == (1, 8) and (out.sequences != tiny_sdar.mask_token_id).all()
    # the first block had 4 - lead masks (one per step), then whole blocks; the answer is cut at 8
    assert out.tokens_per_step[0] == [1] * (8 + 4 - lead)
    # one token per step, the most confident: the first step's choice is the argmax over the first
    # block's masked positions of a full forward of the prompt with them masked
    first_block = torch.tensor(prompt + [tiny_sdar.mask_token_id] * (4 - lead))
    probs = tiny_sdar(first_block[None])[0, len(prompt) :].softmax(-1)
    j = int(probs.max(-1).values.argmax())
    assert out.unmask_step[0, j] == 0 and out.sequences[0, j] == probs[j].argmax()


def test_fast_dllm_v2_decodes_in_its_own_blocks(tiny_v2, tokenizer):
    with pytest.raises(ValueError, match="block_length"):
        generate(tiny_v2, [tokenizer.encode("hi")], config=GenerationConfig(gen_length=32, block_length=16))


def test_sdar_decodes_in_a_block_other_than_its_training_block(tiny_sdar, tokenizer, tmp_path):
    """As SDAR's evaluation allows: block_length 8 on a model trained in blocks of 4 attends
    block-causally in blocks of 8, prompt included. The first step's choice is the argmax of a
    forward written from the weights with that mask (which differs from the training block's), and
    the exact cache gives the uncached tokens."""
    folder = save_pretrained(tiny_sdar, tmp_path / "sdar", tokenizer, dtype=torch.float32)
    prompt = tokenizer.encode("Question: 3 + 4 = ? Answer:")
    lead = len(prompt) % 8
    assert lead % 4, "the prompt must end inside a block of 4 for the two masks to differ"
    config = GenerationConfig.for_model(
        tiny_sdar,
        GenerationConfig(gen_length=16, block_length=8, steps=16, threshold=None),
        temperature=0.0,
        block_length=8,
    )
    assert config.block_length == 8
    cached = generate(tiny_sdar, [prompt], config=config)
    uncached = generate(tiny_sdar, [prompt], config=config.replace(cache="none"))
    assert torch.equal(cached.sequences, uncached.sequences)
    first_block = torch.tensor(prompt + [tiny_sdar.mask_token_id] * (8 - lead))
    probs = reference_forward(folder, first_block, block=8)[len(prompt) :].softmax(-1)
    training_block = reference_forward(folder, first_block, block=4)[len(prompt) :].softmax(-1)
    assert not torch.allclose(probs, training_block, atol=1e-4)
    j = int(probs.max(-1).values.argmax())
    assert cached.unmask_step[0, j] == 0 and cached.sequences[0, j] == probs[j].argmax()


def test_an_unknown_model_type_names_the_families_we_know(tmp_path, tiny_sdar, tokenizer):
    folder = save_pretrained(tiny_sdar, tmp_path / "x", tokenizer, extra_config={"model_type": "mystery"})
    with pytest.raises(ValueError) as e:
        fastdllm.load(str(folder))
    assert "mystery" in str(e.value) and "SDAR (sdar)" in str(e.value) and "Fast-dLLM v2" in str(e.value)


# ---- the references' decoding rules, on hand-checkable cases ----------------------------------------
def test_sdar_quota_rule():
    from fastdllm.engine.decode import BlockClock, Quota

    conf = torch.tensor([[0.95, 0.2, 0.91, 0.3], [0.95, 0.2, 0.9, 0.3]], dtype=torch.float64)
    masked = torch.ones(2, 4, dtype=torch.bool)
    rule = Quota(0.9)
    chosen = rule.select(conf, masked, BlockClock.uniform(masked, 2), None, [0, 1])  # 4 positions over 2 steps
    # row 0: two above 0.9 fill the quota; row 1: 0.9 is not above it, so the top-2 instead
    assert chosen.tolist() == [[True, False, True, False], [True, False, True, False]]
    strict = Quota(0.92)
    assert strict.select(conf[:1], masked[:1], BlockClock.uniform(masked[:1], 2), None, [0]).tolist() == [
        [True, False, True, False]
    ]  # 1 < quota
    many = Quota(0.1)
    assert many.select(conf[:1], masked[:1], BlockClock.uniform(masked[:1], 2), None, [0]).tolist() == [
        [True, True, True, True]
    ]  # all above
    # a block that opens with prompt tokens: the quota is still the block length's share
    lead = torch.tensor([[False, False, True, True]])
    static = Quota(None)
    assert static.select(conf[:1], lead, BlockClock.uniform(lead, 4), None, [0]).tolist() == [
        [False, False, True, False]
    ]


def test_fast_dllm_v2_rules_sub_blocks_and_the_first_position():
    from fastdllm.engine.decode import BlockClock, FirstPositionAtBlockStart, SubBlocks, Threshold

    conf = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.99, 0.99, 0.99, 0.99]])
    masked = torch.ones(1, 8, dtype=torch.bool)
    rule = FirstPositionAtBlockStart(SubBlocks(Threshold(0.9), 4))
    assert rule.select(conf, masked, BlockClock.uniform(masked, 8), None, [0]).tolist() == [
        [True] + [False] * 7
    ]  # the block's first token
    masked[0, 0] = False
    # then the first sub-block only: its most confident, although the second's are all above 0.9
    assert rule.select(conf, masked, BlockClock.uniform(masked, 8, step=1), None, [0]).tolist() == [
        [False, False, False, True] + [False] * 4
    ]
    masked[0, :4] = False
    assert rule.select(conf, masked, BlockClock.uniform(masked, 8, step=2), None, [0]).tolist() == [
        [False] * 4 + [True] * 4
    ]
    # a block opening with prompt tokens has no first token to reveal: the rule decides
    lead = torch.tensor([[False, False, True, True, True, True, True, True]])
    assert rule.select(conf, lead, BlockClock.uniform(lead, 8), None, [0]).tolist() == [
        [False, False, False, True] + [False] * 4
    ]


def test_fast_dllm_v2_decoding_is_the_same_with_the_exact_cache_and_without_any(tiny_v2, tokenizer):
    prompts = [
        tokenizer.encode("Question: 3 + 4 = ?"),
        tokenizer.encode("Question: what is 12 + 30?\nAnswer:"),
        tokenizer.encode("Question: 1 + 1"),
    ]
    exact = GenerationConfig.for_model(tiny_v2, GenerationConfig(gen_length=32, threshold=0.3, stop_at_eos=False))
    assert (exact.block_length, exact.sub_block_length, exact.suffix_window) == (8, 8, 0)
    none = exact.replace(cache="none", suffix_window=None, refresh="full")
    a, n = generate(tiny_v2, prompts, config=exact), generate(tiny_v2, prompts, config=none)
    assert torch.equal(a.sequences, n.sequences) and a.nfe_per_row == n.nfe_per_row
    for i, p in enumerate(prompts):
        alone = generate(tiny_v2, [p], config=exact)
        assert torch.equal(alone.sequences[0], a.sequences[i])
        first_steps = alone.tokens_per_step[0]
        if len(p) % 8 == 0:  # every block starts with its first token alone
            assert first_steps[0] == 1


def test_fast_dllm_v2_block_cache_steps_follow_its_reference(tiny_v2, tokenizer, tmp_path):
    """cache="sub-block" (v2's use_block_cache): a step whose sub-block opens with a mask is a
    whole-block forward, whose logits equal a full block-causal forward; a later step of the
    sub-block recomputes only the sub-block, and its logits equal a forward in which every other
    position's K/V are those of the last whole-block forward (written here from the weights)."""
    from fastdllm.engine.cache import SubBlockCache

    folder = save_pretrained(tiny_v2, tmp_path / "v2", tokenizer, dtype=torch.float32)
    blk, size = tiny_v2.args.block_size, 4
    config = GenerationConfig.for_model(
        tiny_v2,
        GenerationConfig(gen_length=32, threshold=0.3, stop_at_eos=False),
        sub_block_length=size,
        cache="sub-block",
    )
    steps = []

    class Recording(KVRunner):
        def logits(self, pages, seq, policy, row_steps):
            x = seq.x[0].clone()
            out = super().logits(pages, seq, policy, row_steps)
            steps.append((x, seq.starts[0], row_steps[0], out[0].clone()))
            return out

    runner = Recording(tiny_v2).record()
    prompt = tokenizer.encode("Question: what is 12 + 30?\nAnswer:")
    generate(
        tiny_v2, [prompt], config=config, policies=Policies(cache=SubBlockCache.from_config(tiny_v2, config)), kv=runner
    )
    assert len(runner.history) == len(steps)
    # one row: per forward its window [ws, we) and the logits' columns [lo, hi)
    history = [(ws, we, lo, we) for (_, ws, we, _, lo) in (windows[0] for windows in runner.history)]
    last_whole, kinds = None, set()
    # v2 reveals a block's first token at its block-start step, which makes no block cache: the
    # block's next step is a whole-block forward even though its first sub-block opens revealed.
    opened_masked = {start for x, start, step, _ in steps if step == 0 and x[start] == tiny_v2.mask_token_id}
    assert opened_masked
    assert all(
        hi - lo == blk
        for (_, _, lo, hi), (_, start, step, _) in zip(history, steps)
        if step == 1 and start in opened_masked
    )
    for (ws, we, lo, hi), (x, start, step, logits) in zip(history, steps):
        end = start + blk
        masked = (x[start:end] == tiny_v2.mask_token_id).nonzero().flatten() + start
        if hi - lo == blk:  # the whole block
            kinds.add("block-start" if step == 0 else "block")
            stale = []
            ref = reference_forward(folder, x[:end], record=stale)
            last_whole = stale
            assert torch.allclose(logits[masked - start], ref[masked - 1], atol=1e-4, rtol=1e-4)
        else:  # a sub-block that opens revealed: only its positions, against the block cache
            kinds.add("sub-block")
            sub = ws
            assert (we - ws, lo, hi) == (size, sub + 1, sub + size) and x[sub] != tiny_v2.mask_token_id
            ref = reference_forward(
                folder, x[:end], stale=[(k[:end], v[:end]) for k, v in last_whole], fresh=range(sub, sub + size)
            )
            here = masked[(masked >= sub) & (masked < sub + size)]
            assert len(here) and torch.allclose(logits[here - start], ref[here - 1], atol=1e-4, rtol=1e-4)
    assert kinds == {"block-start", "block", "sub-block"}
    # fewer positions than DualCache's whole-block steps, and a row decodes as it does alone in a batch
    other = tokenizer.encode("Question: 3 + 4 = ?")
    batch = generate(tiny_v2, [prompt, other], config=config)
    dual = generate(tiny_v2, [prompt, other], config=config.replace(cache="dual"))
    for i, p in enumerate((prompt, other)):
        assert torch.equal(generate(tiny_v2, [p], config=config).sequences[0], batch.sequences[i])
        assert batch.forward_positions[i] < dual.forward_positions[i]
    with pytest.raises(ValueError, match="cache"):
        GenerationConfig(cache="sub-block")


@pytest.mark.parametrize("name", FAMILIES)
def test_block_diffusion_rows_that_join_decode_as_alone(name, request, tokenizer):
    """Continuous batching: rows join at block boundaries (prompts ending at different places in a
    block, a longer prompt moving the running rows right) and decode token-identically as alone."""
    from .test_continuous import config_for, run_with_joins

    model = request.getfixturevalue(name)
    b = model.args.block_size
    texts = [
        "Question: 3 + 4 = ?",
        "Question: what is 12 + 30?\nAnswer:",
        "Question: 1 + 1",
        "Question: Tom has 5 apples and buys 3 more. How many apples does he have now?\nAnswer:",
    ]
    ps = [tokenizer.encode(t) for t in texts]
    assert len({len(p) % b for p in ps}) > 1
    base = GenerationConfig.for_model(model, GenerationConfig(threshold=0.3, stop_at_eos=False))
    arrivals = {0: [(ps[0], 6 * b), (ps[1], 4 * b)], 1: [(ps[2], 2 * b)], 2: [(ps[3], 3 * b)]}
    rows = run_with_joins(model, arrivals, base, [1, 2, 3, 4])
    alone = [(p, g) for k in sorted(arrivals) for p, g in arrivals[k]]
    for r, (p, g) in zip(rows, alone):
        ref = generate(model, [p], config_for(base, g))
        assert torch.equal(r.answer, ref.sequences[0]), g
        assert r.nfe == ref.nfe_per_row[0] and r.tokens_per_step == ref.tokens_per_step[0]


def test_the_exact_cache_computes_the_prompt_once_and_each_block_twice(tiny_sdar, tokenizer):
    """Work on a hand-checkable case, one token per step: the first forward is the prompt with the
    first block; every later block's first step recomputes the just-finished block (its commit)
    beside the current one; the other steps forward the current block alone."""
    prompt = tokenizer.encode("Question: 3 + 4 = ?", add_special_tokens=False)
    prompt = prompt[: len(prompt) - len(prompt) % 4]  # ends on a block boundary: no shared block
    gen, b = 16, 4
    config = GenerationConfig.for_model(
        tiny_sdar, GenerationConfig(gen_length=gen, block_length=b, threshold=None, stop_at_eos=False), temperature=0.0
    )
    out = generate(tiny_sdar, [prompt], config=config.replace(prefix_cache="off"))  # the loop's own work
    blocks = gen // b
    assert out.nfe == gen and out.prompt_positions == [len(prompt)]
    expected = (len(prompt) + b) + (b - 1) * b + (blocks - 1) * (2 * b + (b - 1) * b)
    assert out.forward_positions == [expected]
    assert out.decode_positions_per_token == (expected - len(prompt)) / out.num_tokens[0]
