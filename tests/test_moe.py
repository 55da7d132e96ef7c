"""Mixture-of-experts models (LLaDA2.0 / 2.1 on the BailingMoeV2 layout): the layout checked
against a forward written here from the checkpoint's files alone (a Python loop over experts),
the router, the experts' grouped compute without host syncs, the exact cache, and LLaDA2's
decoding rules (its proposal; LLaDA2.1's token editing, on a scripted model)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.engine.decode import Editing, LLaDA2Proposal, UnmaskingStrategy
from fastdllm.engine.kv.pages import PagedKVCache
from fastdllm.engine.kv.runner import KVRunner
from fastdllm.engine.policies import Policies
from fastdllm.models.loading import save_pretrained
from fastdllm.models.moe import MoEFeedForward, route
from fastdllm.models.transformer import ModelArgs


def files_forward(folder, ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) of one sequence from config.json and the safetensors alone: fused q/k/v split
    by heads, q/k RMSNorm before a RoPE on the first half of each head, block-causal attention,
    a dense first layer, then per token the sigmoid router (bias for the choice, two best groups),
    its experts one by one, and the shared expert."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(str(f)))
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rot = int(hd * cfg["partial_rotary_factor"])
    eps, block, t = cfg["rms_norm_eps"], cfg["block_size"], ids.shape[0]
    pos = torch.arange(t)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.outer(pos.float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(v):
        r, rest = v[..., :rot], v[..., rot:]
        half = rot // 2
        return torch.cat([r * cos + torch.cat([-r[..., half:], r[..., :half]], -1) * sin, rest], -1)

    def mlp(v, p):
        return (torch.nn.functional.silu(v @ w[p + "gate_proj.weight"].T) * (v @ w[p + "up_proj.weight"].T)) @ w[
            p + "down_proj.weight"
        ].T

    allowed = (pos[None, :] // block) <= (pos[:, None] // block)
    x = w["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        qkv = (h @ w[p + "attention.query_key_value.weight"].T).view(t, heads + 2 * kv, hd)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv], qkv[:, heads + kv :]
        q, k = (
            rope(rms(q, w[p + "attention.query_layernorm.weight"])),
            rope(rms(k, w[p + "attention.key_layernorm.weight"])),
        )
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)).masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(t, -1) @ w[p + "attention.dense.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if i < cfg["first_k_dense_replace"]:
            x = x + mlp(h, p + "mlp.")
            continue
        out = mlp(h, p + "mlp.shared_experts.")
        n, groups = cfg["num_experts"], cfg["n_group"]
        for j in range(t):
            scores = torch.sigmoid(h[j] @ w[p + "mlp.gate.weight"].T)
            choice = scores + w[p + "mlp.gate.expert_bias"]
            group_score = choice.view(groups, -1).topk(2).values.sum(-1)
            keep = set(group_score.topk(cfg["topk_group"]).indices.tolist())
            allowed_e = [e for e in range(n) if e // (n // groups) in keep]
            best = sorted(allowed_e, key=lambda e: -choice[e].item())[: cfg["num_experts_per_tok"]]
            weights = scores[best] / scores[best].sum() * cfg["routed_scaling_factor"]
            for e, wt in zip(best, weights):
                out[j] = out[j] + wt * mlp(h[j], p + f"mlp.experts.{e}.")
        x = x + out
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def olmoe_files_forward(folder, ids: torch.Tensor) -> torch.Tensor:
    """LLaDA-MoE's logits (T, V) from its files alone: bidirectional attention, q/k norm per head
    before RoPE, then per token the softmax router's top-k experts weighted by their (biased,
    unnormalised) scores, plus the shared expert."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(str(f)))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, t = cfg["hidden_size"] // heads, cfg["rms_norm_eps"], ids.shape[0]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(t).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(v):
        return v * cos + torch.cat([-v[..., hd // 2 :], v[..., : hd // 2]], -1) * sin

    def mlp(v, p):
        return (torch.nn.functional.silu(v @ w[p + "gate_proj.weight"].T) * (v @ w[p + "up_proj.weight"].T)) @ w[
            p + "down_proj.weight"
        ].T

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, hd), w[p + "self_attn.q_norm.weight"])
        k = rms((h @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, hd), w[p + "self_attn.k_norm.weight"])
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, hd)
        q, k = rope(q), rope(k).repeat_interleave(heads // kv, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)).softmax(-1)
        x = (
            x
            + torch.einsum("hqk,khd->qhd", att, v.repeat_interleave(heads // kv, 1)).reshape(t, -1)
            @ w[p + "self_attn.o_proj.weight"].T
        )
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if not cfg["moe_layer_freq"][i]:
            x = x + mlp(h, p + "mlp.")
            continue
        out = mlp(h, p + "shared_expert.")
        for j in range(t):
            scores = (h[j] @ w[p + "mlp.gate.weight"].T).softmax(-1) + w.get(p + "mlp.expert_bias", 0)
            top = scores.topk(cfg["num_experts_per_tok"])
            for e, wt in zip(top.indices.tolist(), top.values):
                out[j] = out[j] + wt * mlp(h[j], p + f"mlp.experts.{e}.")
        x = x + out
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def masked_ids(model, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.args.vocab_size, (length,), generator=g)
    ids[ids == model.mask_token_id] = 0
    ids[length // 2 :: 3] = model.mask_token_id
    return ids


def test_the_llada2_layout_loads_and_its_logits_equal_a_forward_from_its_files(tiny_llada2, tokenizer, tmp_path):
    folder = save_pretrained(tiny_llada2, tmp_path / "llada2", tokenizer, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe" and cfg["auto_map"]["AutoModelForCausalLM"].startswith("modeling_llada2")
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["first_k_dense_replace"] == 1 and cfg["num_experts"] == 8
    names = load_file(str(folder / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate.expert_bias" in names and "model.layers.1.attention.query_key_value.weight" in names
    model, _ = fastdllm.load(folder, dtype="float32")
    ids = masked_ids(model, 3 * model.args.block_size + 5)
    ours = model(ids[None])[0]
    assert torch.allclose(ours, files_forward(folder, ids), atol=1e-4, rtol=1e-4)
    # the router's bias decides which experts run: without it the logits change
    with torch.no_grad():
        model.layers[1].feed_forward.expert_bias.zero_()
    assert not torch.allclose(model(ids[None])[0], ours, atol=1e-3)


def test_the_llada_moe_layout_loads_as_its_own_family_and_its_logits_equal_a_forward_from_its_files(
    tiny_llada_moe, tokenizer, tmp_path
):
    folder = save_pretrained(tiny_llada_moe, tmp_path / "lladamoe", tokenizer, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["moe_layer_freq"] == [0, 1]  # as LLaDA-MoE's checkpoints say
    model, _ = fastdllm.load(folder, dtype="float32")
    assert model.family.name == "LLaDA-MoE" and not model.args.block_size
    ids = masked_ids(model, 40)
    assert torch.allclose(model(ids[None])[0], olmoe_files_forward(folder, ids), atol=1e-4, rtol=1e-4)
    (folder / "config.json").write_text(json.dumps({**cfg, "moe_layer_freq": [1, 0]}))
    with pytest.raises(ValueError, match="moe_layer_freq"):
        fastdllm.load(folder)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_llada_moe_decodes_through_every_cache_policy_and_in_a_batch_as_alone(cache, tiny_llada_moe, tokenizer):
    prompts = [tokenizer.encode("Question: 3 + 4 = ?"), tokenizer.encode("Question: what is 12 + 30?\nAnswer:")]
    for rule in (dict(threshold=None, steps=16), dict(threshold=0.02), dict(factor=1.0)):
        config = GenerationConfig(gen_length=32, block_length=16, cache=cache, stop_at_eos=False, **rule)
        both = generate(tiny_llada_moe, prompts, config=config)
        assert (both.sequences != tiny_llada_moe.mask_token_id).all()
        for i, p in enumerate(prompts):
            alone = generate(tiny_llada_moe, [p], config=config)
            assert torch.equal(alone.sequences[0], both.sequences[i]), (cache, rule)


def test_routing_keeps_the_best_groups_and_weighs_by_unbiased_scores():
    args = ModelArgs(
        dim=4,
        n_layers=1,
        n_heads=1,
        n_kv_heads=1,
        hidden_dim=4,
        vocab_size=4,
        max_seq_len=4,
        n_experts=8,
        n_active_experts=2,
        n_expert_groups=4,
        active_expert_groups=2,
        routed_scaling=2.0,
    )
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731  sigmoid^-1
    scores = torch.tensor([[0.9, 0.2, 0.5, 0.5, 0.7, 0.1, 0.6, 0.55]])  # groups: {0,1} {2,3} {4,5} {6,7}
    logits = scores.clone().apply_(logit)
    chosen, weights = route(logits, args, None)
    # group scores (sum of the best two): 1.1, 1.0, 0.8, 1.15 -> groups 3 and 0 kept, so expert 4
    # (0.7) is out and the best two are 0 (0.9) and 6 (0.6)
    assert sorted(chosen[0].tolist()) == [0, 6]
    assert torch.allclose(weights[0].sum(), torch.tensor(2.0))
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, -0.1, 0])
    chosen, weights = route(logits, args, bias)  # the bias moves the choice to expert 7...
    assert sorted(chosen[0].tolist()) == [0, 7]
    w = dict(zip(chosen[0].tolist(), weights[0].tolist()))  # ...but the weights are its unbiased score
    assert w[7] == pytest.approx(2.0 * 0.55 / (0.9 + 0.55), rel=1e-5)


def test_grouped_expert_compute_equals_the_per_pair_one(tiny_llada2):
    moe = tiny_llada2.layers[1].feed_forward
    assert isinstance(moe, MoEFeedForward)
    x = torch.randn(2, 12, tiny_llada2.args.dim)
    import fastdllm.models.moe as moe_module

    grouped = moe(x)
    original = moe_module._grouped_mm_ok
    moe_module._grouped_mm_ok = lambda *a: False
    try:
        gathered = moe(x)
    finally:
        moe_module._grouped_mm_ok = original
    assert torch.allclose(grouped, gathered, atol=1e-5, rtol=1e-5)


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for a device result: reading a scalar
    (`.item()`, `bool(tensor)`, `.tolist()`) and data-dependent shapes."""

    WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "bincount", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.count, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.WAITS:
            self.count += 1
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["tiny_llada2", "tiny_llada_moe"])
def test_a_moe_forward_never_waits_on_the_host(name, request):
    model = request.getfixturevalue(name)
    x = masked_ids(model, 20)[None].repeat(3, 1)
    cache = PagedKVCache.for_rows(model, 3, 20)
    with HostSyncs() as syncs:
        model.packed_logits(x, [(i, 0, 20, 20, 16) for i in range(3)], cache)
        model.packed_logits(x, [(i, 16, 20, 20, 16) for i in range(3)], cache)
    assert syncs.count == 0, syncs.ops
    # the counter sees a sync where there is one
    with HostSyncs() as syncs:
        bool((x == 3).any())
    assert syncs.count == 1


def test_llada2_decoding_is_the_same_with_the_exact_cache_and_alone(tiny_llada2, tokenizer):
    prompts = [tokenizer.encode("Question: 3 + 4 = ?"), tokenizer.encode("Question: what is 12 + 30?\nAnswer:")]
    b = tiny_llada2.args.block_size
    assert len({len(p) % b for p in prompts}) == 2
    for rule in (dict(threshold=None), dict(threshold=0.3), dict(threshold=0.3, editing_threshold=0.2)):
        exact = GenerationConfig.for_model(
            tiny_llada2, GenerationConfig(gen_length=3 * b, block_length=b, stop_at_eos=False, **rule)
        )
        assert (exact.block_length, exact.cache, exact.unmasking) == (b, "dual", "quota")
        none = exact.replace(cache="none", suffix_window=None, refresh="full")
        a, n = generate(tiny_llada2, prompts, config=exact), generate(tiny_llada2, prompts, config=none)
        assert torch.equal(a.sequences, n.sequences) and a.nfe_per_row == n.nfe_per_row, rule
        for i, p in enumerate(prompts):
            assert torch.equal(generate(tiny_llada2, [p], config=exact).sequences[0], a.sequences[i]), rule


def test_stacked_experts_load_from_shards_and_a_missing_one_is_named(tiny_llada2, tokenizer, tmp_path):
    folder = save_pretrained(tiny_llada2, tmp_path / "sharded", tokenizer, dtype=torch.float32, max_shard_bytes=60_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    model, _ = fastdllm.load(folder, dtype="float32")
    assert torch.equal(model.layers[1].feed_forward.w2, tiny_llada2.layers[1].feed_forward.w2)
    shard = next(
        f
        for f in folder.glob("model-*.safetensors")
        if "model.layers.1.mlp.experts.3.up_proj.weight" in load_file(str(f))
    )
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="experts.3.up_proj"):
        fastdllm.load(folder)


def test_llada2_config_checks(tiny_llada2, tokenizer, tmp_path):
    folder = save_pretrained(tiny_llada2, tmp_path / "c", tokenizer, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    for change, match in (
        ({"use_bias": True}, "use_bias"),
        ({"num_experts": 6}, "n_group"),
        ({"score_function": "softmax"}, "score_function"),
    ):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=match):
            fastdllm.load(folder)
    del cfg["use_bias"]  # LLaDA2MoeConfig's default is a biased output projection, which we do not run
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_bias"):
        fastdllm.load(folder)


def test_llada2_proposal_is_greedy_at_temperature_0_and_samples_filtered_probabilities():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    greedy = LLaDA2Proposal(GenerationConfig(temperature=0.0))
    tokens, conf = greedy(logits, None, [0])
    assert tokens.item() == 0 and conf.item() == pytest.approx(logits.softmax(-1)[0, 0, 0].item())
    sampled = LLaDA2Proposal(GenerationConfig(temperature=1.0, top_k=2))
    gens = [torch.Generator().manual_seed(0)]
    draws = [sampled(logits, gens, [0]) for _ in range(200)]
    assert {t.item() for t, _ in draws} == {0, 1}  # top-k keeps two tokens
    p = torch.tensor([2.0, 1.0]).softmax(-1)
    assert all(c.item() == pytest.approx(p[t.item()].item()) for t, c in draws)  # probability after filtering


# ---- LLaDA2.1's token editing on a scripted model -----------------------------------------------
class Scripted(KVRunner):
    """Returns the next of a list of per-step logits, whatever the sequence."""

    def __init__(self, model, steps):
        super().__init__(model)
        self.steps, self.calls = steps, 0

    def logits(self, pages, seq, policy, steps):
        pages.work.append([(i, seq.width, seq.x.shape[1]) for i in range(len(steps))])
        out = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        return out


def peaked(vocab: int, picks: list[tuple[int, float]]) -> torch.Tensor:
    """(1, len(picks), vocab) logits whose softmax gives token t probability p at each position."""
    out = torch.zeros(1, len(picks), vocab)
    for i, (t, p) in enumerate(picks):
        out[0, i, t] = math.log(p * (vocab - 1) / (1 - p))
    return out


def test_editing_rewrites_revealed_tokens_and_ends_the_block_after_a_quiet_step(tiny_llada, tokenizer):
    v = tiny_llada.args.vocab_size
    A, A2, B, X, C, D = 10, 11, 12, 13, 14, 15
    script = [
        peaked(v, [(A, 0.95), (B, 0.95), (C, 0.2), (D, 0.2)]),  # reveals A, B
        peaked(v, [(A2, 0.8), (B, 0.99), (C, 0.95), (D, 0.3)]),  # reveals C, edits A -> A2
        peaked(v, [(A2, 0.9), (B, 0.9), (C, 0.9), (D, 0.95)]),  # reveals D, no edit
        peaked(v, [(A2, 0.9), (X, 0.6), (C, 0.9), (D, 0.9)]),  # no masks left: edits B -> X
        peaked(v, [(A2, 0.9), (X, 0.9), (C, 0.9), (D, 0.9)]),
    ]  # nothing changes: the block ends
    prompt = tokenizer.encode("Question: 1 + 1")
    base = GenerationConfig(
        gen_length=4,
        block_length=4,
        steps=4,
        threshold=0.9,
        unmasking="quota",
        cache="none",
        suffix_window=None,
        refresh="full",
        stop_at_eos=False,
    )

    def run(**changes):
        config = base.replace(**changes)
        policies = Policies(strategy=UnmaskingStrategy.from_config(config))
        return generate(tiny_llada, [prompt], config=config, policies=policies, kv=Scripted(tiny_llada, script))

    plain = run()
    assert plain.sequences[0].tolist() == [A, B, C, D] and plain.nfe == 3
    edited = run(editing_threshold=0.5, max_post_steps=2)
    assert edited.sequences[0].tolist() == [A2, X, C, D] and edited.nfe == 5
    assert edited.tokens_per_step[0] == [2, 1, 1, 0, 0]
    bounded = run(editing_threshold=0.5, max_post_steps=1)  # one step after the last mask, then stop
    assert bounded.sequences[0].tolist() == [A2, X, C, D] and bounded.nfe == 4
    none_after = run(editing_threshold=0.5, max_post_steps=0)
    assert none_after.sequences[0].tolist() == [A2, B, C, D] and none_after.nfe == 3
    confident = run(editing_threshold=0.95)  # no proposal is confident enough to edit: one quiet post step
    assert confident.sequences[0].tolist() == [A, B, C, D] and confident.nfe == 4


def test_editing_never_touches_prompt_tokens_or_masked_positions():
    editing = Editing(0.5, 16)
    current = torch.tensor([[1, 2, 99, 4]])
    tokens = torch.tensor([[5, 2, 7, 8]])
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.4]])
    editable = torch.tensor([[False, True, False, True]])  # a prompt token, revealed, masked, revealed
    assert editing.select(tokens, conf, current, editable).tolist() == [[False, False, False, False]]
    editable = torch.tensor([[True, True, False, True]])
    assert editing.select(tokens, conf, current, editable).tolist() == [[True, False, False, False]]


def test_editing_settings_are_checked():
    from fastdllm.config import ConfigError

    with pytest.raises(ConfigError, match="editing_threshold"):
        GenerationConfig(editing_threshold=1.5)
    with pytest.raises(ConfigError, match="max_post_steps"):
        GenerationConfig(max_post_steps=-1)


def test_upcycling_a_dense_model_keeps_its_function_and_training_grows_the_experts(tiny_llada, tokenizer):
    from fastdllm.embedded import train
    from fastdllm.embedded.recipe import new_model

    moe = new_model("lladamoe", "micro", tokenizer, shared_expert_hidden_dim=tiny_llada.args.hidden_dim, qk_norm=False)
    train.transplant_weights(moe, tiny_llada)
    ids = masked_ids(tiny_llada, 30)[None]
    with torch.no_grad():
        assert torch.equal(moe.eval()(ids), tiny_llada(ids))
    moe.train()
    batch, starts = train.make_batch(tokenizer, 0, 0, 2048, "talk")
    loss = train.sft_loss(moe, batch, starts, torch.Generator().manual_seed(0))
    loss.backward()
    layer = moe.layers[1].feed_forward
    assert layer.w2.grad.abs().sum() > 0 and layer.router.weight.grad is not None


def test_split_upcycling_partitions_the_dense_mlp_among_the_experts(tokenizer):
    """A dense block-diffusion model's MLP split into LLaDA2's shared and routed experts: every hidden
    unit goes to exactly one of them, the shared expert takes the most important units, and with
    equal router scores the two chosen experts add exactly their units' part of the dense MLP."""
    from fastdllm.embedded import train
    from fastdllm.embedded.recipe import new_model

    dense = new_model("sdar", "micro", tokenizer, seed=3, block_size=4)
    moe = new_model(
        "llada2_moe", "micro", tokenizer, moe_hidden_dim=4, shared_expert_hidden_dim=32, rope_dim=16, block_size=4
    )
    sample, _ = train.make_batch(tokenizer, 0, 0, 2048, "story")
    train.transplant_weights(moe, dense, sample)
    dense_mlp, layer = dense.layers[1].feed_forward, moe.layers[1].feed_forward
    rows = [tuple(r.tolist()) for r in dense_mlp.w1.weight]
    parts = [layer.shared.w1.weight] + list(layer.w1)
    carved = [tuple(r.tolist()) for part in parts for r in part]
    assert sorted(carved) == sorted(rows)  # a partition of the units
    assert torch.equal(moe.layers[0].feed_forward.w1.weight, dense.layers[0].feed_forward.w1.weight)  # dense layer 0
    # equal scores: the chosen pair's output is their units' share, times 2 x k / routed_scaling x 1/k
    x = torch.randn(5, moe.args.dim)
    with torch.no_grad():
        layer.router.weight.zero_()
        chosen, weights = moe_route(layer, x)
        units = {tuple(r.tolist()): j for j, r in enumerate(dense_mlp.w1.weight)}
        act = torch.nn.functional.silu(x @ dense_mlp.w1.weight.T) * (x @ dense_mlp.w3.weight.T)
        for t in range(5):
            keep = [
                units[tuple(r.tolist())]
                for part in [layer.shared.w1.weight] + [layer.w1[e] for e in chosen[t]]
                for r in part
            ]
            expected = act[t, keep] @ dense_mlp.w2.weight[:, keep].T
            torch.testing.assert_close(layer(x[t : t + 1]), expected[None], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="init_from"):
        train.transplant_weights(
            new_model("llada2_moe", "micro", tokenizer, moe_hidden_dim=8, shared_expert_hidden_dim=32, block_size=4),
            dense,
            sample,
        )
    with pytest.raises(ValueError, match="init_from"):
        train.transplant_weights(moe, dense)  # no sample to rank the units on


def moe_route(layer, x):
    from fastdllm.models.moe import route

    return route(
        torch.nn.functional.linear(x.float(), layer.router.weight.float()),
        layer.args,
        getattr(layer, "expert_bias", None),
    )


def test_expert_bias_balancing_moves_choices_toward_the_less_chosen_experts(tiny_llada2, tokenizer):
    """DeepSeek-V3's auxiliary-loss-free balancing, as LLaDA2 trains: after a training forward the
    bias of an expert chosen more often than average falls by the update speed, of one chosen less
    often rises; the routing weights (un-biased scores) are not touched."""
    from fastdllm.embedded import train

    model = copy.deepcopy(tiny_llada2).train()
    layer = model.layers[1].feed_forward
    batch, starts = train.make_batch(tokenizer, 0, 0, 1024, "story")
    with torch.no_grad():
        model(batch)
    load = layer.load.float().clone()
    before = layer.expert_bias.clone()
    train.balance_experts(model, speed=0.01)
    step = layer.expert_bias - before
    torch.testing.assert_close(step, 0.01 * torch.sign(load.mean() - load))
    assert (step[load > load.mean()] < 0).all() and (step[load < load.mean()] > 0).all()
    assert layer.load is None  # one update per forward
    train.balance_experts(model, speed=0.01)
    torch.testing.assert_close(layer.expert_bias, before + step)  # nothing to balance without a new forward
    model.eval()
    with torch.no_grad():
        model(batch[:1])
    assert layer.load is None  # inference records nothing


def test_training_only_the_experts_leaves_the_dense_model_as_it_was(tiny_llada, tokenizer):
    from fastdllm.embedded import train
    from fastdllm.embedded.recipe import new_model

    moe = new_model("lladamoe", "micro", tokenizer, shared_expert_hidden_dim=tiny_llada.args.hidden_dim, qk_norm=False)
    train.transplant_weights(moe, tiny_llada)
    params = train.trainable_parameters(moe, "experts")
    names = {n for n, p in moe.named_parameters() if p.requires_grad}
    assert names and all(".feed_forward." in n and ".shared." not in n for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"w1", "w2", "w3", "weight"}  # the router's weight
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch, starts = train.make_batch(tokenizer, 0, 0, 2048, "talk")
    moe.train()
    train.sft_loss(moe, batch, starts, torch.Generator().manual_seed(0)).backward()
    opt.step()
    for n, p in moe.named_parameters():
        assert torch.equal(p, before[n]) != (n in names), n  # the experts moved, nothing else did
    with pytest.raises(ValueError, match="trainable"):
        train.trainable_parameters(tiny_llada, "experts")
    with pytest.raises(ValueError, match="trainable"):
        train.trainable_parameters(moe, "heads")


def test_eos_early_stop_ends_the_row_inside_its_block(tiny_llada, tokenizer):
    """LLaDA2.0's eos_early_stop on a scripted model: a stop token revealed behind a masked position
    does not stop the row; once every position before it is revealed the row stops in that step, its
    block's other masks EOS, and the answer is the one stopping after the block gives."""
    v, eos = tiny_llada.args.vocab_size, tiny_llada.args.eos_token_id
    A, B, D = 10, 12, 15
    script = [
        peaked(v, [(A, 0.95), (B, 0.3), (eos, 0.95), (D, 0.2)]),  # reveals A and EOS, B still masked
        peaked(v, [(A, 0.9), (B, 0.95), (eos, 0.9), (D, 0.3)]),  # reveals B: nothing masked before EOS
        peaked(v, [(A, 0.9), (B, 0.9), (eos, 0.9), (D, 0.95)]),
    ]  # (without early stop) reveals D
    prompt = tokenizer.encode("Question: 1 + 1")
    base = GenerationConfig(
        gen_length=8,
        block_length=4,
        steps=8,
        threshold=0.9,
        unmasking="quota",
        cache="none",
        suffix_window=None,
        refresh="full",
    )

    def run(**changes):
        config = base.replace(**changes)
        policies = Policies(strategy=UnmaskingStrategy.from_config(config))
        return generate(tiny_llada, [prompt], config=config, policies=policies, kv=Scripted(tiny_llada, script))

    after_block = run()
    assert after_block.sequences[0, :4].tolist() == [A, B, eos, D] and after_block.nfe == 3
    early = run(eos_early_stop=True)
    assert early.sequences[0].tolist() == [A, B] + [eos] * 6 and early.nfe == 2
    assert early.num_tokens == after_block.num_tokens == [2]


def test_eos_early_stop_with_editing_stops_after_the_block_as_llada21_does(tiny_llada, tokenizer):
    """LLaDA2.1's loop (editing on) stops only after a block whose answer holds EOS, so an EOS revealed
    early may still be edited away: the row then goes on to its next block; one that keeps its EOS
    stops after the block's quiet post step, not in the step that made it final (2.0's rule)."""
    v, eos = tiny_llada.args.vocab_size, tiny_llada.args.eos_token_id
    A, B, C, D = 10, 12, 14, 15
    reveal = [
        peaked(v, [(A, 0.95), (B, 0.3), (eos, 0.95), (D, 0.2)]),  # reveals A and EOS, B still masked
        peaked(v, [(A, 0.9), (B, 0.95), (eos, 0.9), (D, 0.3)]),
    ]  # reveals B: 2.0 would stop here
    keeps = [peaked(v, [(A, 0.9), (B, 0.9), (eos, 0.9), (D, 0.95)])]  # reveals D; then quiet steps
    edits = [
        peaked(v, [(A, 0.9), (B, 0.9), (C, 0.8), (D, 0.95)]),  # reveals D and edits EOS -> C
        peaked(v, [(A, 0.9), (B, 0.9), (C, 0.9), (D, 0.9)]),
    ]  # quiet; the next block: A B C D
    prompt = tokenizer.encode("Question: 1 + 1")
    config = GenerationConfig(
        gen_length=8,
        block_length=4,
        steps=8,
        threshold=0.9,
        unmasking="quota",
        cache="none",
        suffix_window=None,
        refresh="full",
        editing_threshold=0.5,
        eos_early_stop=True,
    )

    def run(script):
        policies = Policies(strategy=UnmaskingStrategy.from_config(config))
        return generate(tiny_llada, [prompt], config=config, policies=policies, kv=Scripted(tiny_llada, script))

    kept = run(reveal + keeps)
    assert kept.sequences[0].tolist() == [A, B, eos, D] + [eos] * 4 and kept.nfe == 4
    edited = run(reveal + edits)
    assert edited.sequences[0].tolist() == [A, B, C, D, A, B, C, D]


def test_a_llada_moe_checkpoint_without_qk_norms_saves_and_loads(tokenizer, tmp_path):
    from fastdllm.embedded.recipe import new_model
    from fastdllm.models.loading import load_model, save_pretrained

    moe = new_model("lladamoe", "micro", tokenizer, qk_norm=False).eval()
    folder = save_pretrained(moe, tmp_path / "m", tokenizer, dtype=torch.float32)
    back = load_model(folder, dtype=torch.float32)
    assert not back.args.qk_norm
    ids = masked_ids(moe, 20)[None]
    with torch.no_grad():
        assert torch.equal(back(ids), moe(ids))
