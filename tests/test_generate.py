"""The decoding engine. Exactness anchors, batching, stop-at-EOS, schedules, validation."""

from __future__ import annotations

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig, generate, stream_blocks
from fastdllm.engine.decode import BlockClock, DecodeView, Factor, Threshold, UnmaskingStrategy, linear_schedule_at
from fastdllm.engine.policies import Policies

from .conftest import RefreshingRunner


def prompts(tokenizer):
    return [
        tokenizer.encode("Question: Tom has 5 apples. He buys 3 more."),
        tokenizer.encode("Hi"),
        tokenizer.encode("Mia has 12 pencils and gives 2 to Ann. How many pencils does Mia have now?"),
    ]


# ---- exactness anchor: caches refreshed at every step == no cache ---------------------------------
@pytest.mark.parametrize("arch", ["tiny_llada", "tiny_dream"])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_refreshed_caches_equal_no_cache(arch, threshold, request, tokenizer):
    model = request.getfixturevalue(arch)
    base = dict(gen_length=32, block_length=8, threshold=threshold, stop_at_eos=False)
    ref = generate(model, prompts(tokenizer), config=GenerationConfig(cache="none", **base))
    cfg = GenerationConfig(**base)
    # The same unmasking policy as without a cache (Dream's block start differs with one: tested below).
    strategy = UnmaskingStrategy.from_config(cfg)
    for cache in ("prefix", "dual"):  # a runner and a decoder object plug into the loop directly
        out = generate(
            model,
            prompts(tokenizer),
            config=cfg.replace(cache=cache, refresh="full"),
            policies=Policies(strategy=strategy),
            kv=RefreshingRunner(model),
        )
        assert torch.equal(out.sequences, ref.sequences), cache
        assert out.nfe_per_row == ref.nfe_per_row


def test_stale_caches_run_fewer_full_forwards(tiny_llada, tokenizer):
    """Without refreshes the caches really are used (window forwards), and decode everything."""
    calls = []
    orig = tiny_llada.packed_logits

    def spy(x, windows, cache, **kw):
        calls.append([(lo, hi) for _, lo, hi, _, _ in windows])
        return orig(x, windows, cache, **kw)

    tiny_llada.packed_logits = spy
    try:
        out = generate(
            tiny_llada,
            prompts(tokenizer),
            config=GenerationConfig.fast_dllm(gen_length=32, block_length=8, threshold=None, cache="dual"),
        )
    finally:
        del tiny_llada.packed_logits
    full = sum(all(lo == 0 for lo, _ in w) for w in calls)
    assert full == 4 and len(calls) == out.nfe == 32
    assert all(hi - lo == 8 for w in calls for lo, hi in w if lo > 0)
    assert not (out.sequences == tiny_llada.mask_token_id).any()


# ---- threshold / factor / schedules ---------------------------------------------------------------
def test_unreachable_threshold_is_the_one_token_baseline(tiny_llada, tokenizer):
    base = dict(gen_length=32, block_length=8, cache="none", suffix_window=None, stop_at_eos=False)
    thr = generate(tiny_llada, prompts(tokenizer), config=GenerationConfig(threshold=1.0, **base))
    ref = generate(tiny_llada, prompts(tokenizer), config=GenerationConfig(threshold=None, steps=32, **base))
    assert torch.equal(thr.sequences, ref.sequences)
    assert thr.nfe == ref.nfe == 32
    assert all(set(t) == {1} for t in thr.tokens_per_step)


def test_threshold_rule():
    conf = torch.tensor([[0.95, 0.2, 0.91, 0.9, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5]])
    masked = torch.tensor([[True, True, True, False, True], [True, True, True, True, True]])
    chosen = Threshold(0.9).select(conf, masked, 0, None, [0, 1])
    # row 0: >= 0.9 among masked (0.9 at index 3 is not masked); row 1: none reach it -> the top one
    assert chosen.tolist() == [[True, False, True, False, False], [False, False, False, False, True]]


def test_factor_rule_takes_exactly_the_passing_ranks():
    # factor 1: rank m passes when c_m >= 1 - 1/(m+1): 0.5, 0.667, 0.75, 0.8
    conf = torch.tensor([[0.5, 0.99, 0.9, 0.95], [0.99, 0.6, 0.3, 0.1], [0.2, 0.1, 0.05, 0.01]])
    masked = torch.ones_like(conf, dtype=torch.bool)
    chosen = Factor(1.0).select(conf, masked, 0, None, [0, 1, 2])
    # row 0: 0.99, 0.95, 0.9 pass; 0.5 (last rank) fails -> 3 (the reference's quirk would take 4)
    # row 1: 0.99 passes, 0.6 < 0.667 fails -> 1; row 2: none pass -> at least one
    assert chosen.sum(-1).tolist() == [3, 1, 1]
    assert chosen[0].tolist() == [False, True, True, True]


@pytest.mark.parametrize(
    "masks, steps, expected",
    [
        (32, 32, [1] * 32),
        (32, 5, [7, 7, 6, 6, 6]),
        (10, 4, [3, 3, 2, 2]),
        (5, 8, [1, 1, 1, 1, 1, 0, 0, 0]),
        (32, 1, [32]),
        (7, 7, [1] * 7),
        (0, 3, [0, 0, 0]),
    ],
)
def test_linear_schedule_matches_llada(masks, steps, expected):
    # LLaDA's get_num_transfer_tokens: base = masks // steps, the remainder to the first steps
    opened, masked = torch.tensor([masks]), torch.ones(1, max(masks, 1), dtype=torch.bool)
    counts = [linear_schedule_at(opened, BlockClock([k], [steps], opened), masked).item() for k in range(steps)]
    assert counts == expected
    assert sum(expected) == masks


def test_steps_spread_over_blocks():
    cfg = GenerationConfig(gen_length=64, block_length=16, steps=10, threshold=None)
    assert cfg.steps_per_block() == [3, 3, 2, 2]


def test_one_step_per_block_leaves_no_mask(tiny_llada, tokenizer):
    cfg = GenerationConfig(gen_length=32, block_length=8, steps=4, threshold=None, cache="dual", stop_at_eos=False)
    out = generate(tiny_llada, prompts(tokenizer), config=cfg)
    assert not (out.sequences == tiny_llada.mask_token_id).any()
    assert out.nfe == 4 and all(t == [8, 8, 8, 8] for t in out.tokens_per_step)


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_dream_algorithms_follow_the_timestep_schedule(tiny_dream, tokenizer, alg, cache):
    cfg = GenerationConfig(
        gen_length=32, block_length=32, steps=8, threshold=None, cache=cache, alg=alg, seed=3, stop_at_eos=False
    )
    out = generate(tiny_dream, prompts(tokenizer), config=cfg)
    assert not (out.sequences == tiny_dream.mask_token_id).any()
    if alg != "origin":
        # linspace(1, eps, 9): int(n * (1 - s/t)) per step, all at the last; with a cache the
        # block-start step reveals the block's first position instead (Fast-dLLM's Dream)
        t = torch.linspace(1, 1e-3, 9)
        n, expected = 32, []
        for i in range(8):
            k = n if i == 7 else int(torch.tensor(float(n)) * (1 - t[i + 1] / t[i]))
            if i == 0 and cache != "none":
                k = 1
            expected.append(k)
            n -= k
        assert out.tokens_per_step[0] == expected
    # with threshold, every Dream algorithm works too
    cfg2 = cfg.replace(threshold=0.5)
    out2 = generate(tiny_dream, prompts(tokenizer), config=cfg2)
    assert not (out2.sequences == tiny_dream.mask_token_id).any()


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_dream_threshold_compares_probabilities_for_every_alg(alg):
    def propose(logits, config, generators, rows):
        return UnmaskingStrategy.from_config(config).propose(logits, generators, rows)

    logits = torch.randn(2, 6, 50) * 4
    probs = logits.softmax(-1)
    tokens, conf = propose(logits, GenerationConfig(alg=alg, threshold=0.9), [None, None], [None, None])
    torch.testing.assert_close(conf, probs.max(-1).values)
    assert torch.equal(tokens, probs.argmax(-1))
    _, conf_factor = propose(logits, GenerationConfig(alg=alg, threshold=None, factor=1.0), [None, None], [None, None])
    torch.testing.assert_close(conf_factor, probs.max(-1).values)


# ---- batching, seeds, stop-at-EOS, streaming ------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        dict(threshold=None, cache="none"),
        dict(threshold=0.2, cache="dual"),
        dict(threshold=None, factor=1.0, cache="prefix"),
        dict(threshold=None, cache="dual", temperature=0.7, remasking="random"),
        dict(threshold=None, cache="prefix", alg="entropy", temperature=0.5, alg_temp=0.3),
        # rows finish a block at different steps: a finished row must not draw from its stream
        dict(threshold=0.002, cache="dual", temperature=0.8),
        dict(threshold=0.002, cache="none", alg="maskgit_plus", temperature=0.6),
    ],
)
@pytest.mark.parametrize("arch", ["tiny_llada", "tiny_dream"])
def test_batch_equals_single(arch, overrides, request, tokenizer):
    model = request.getfixturevalue(arch)
    cfg = GenerationConfig(gen_length=32, block_length=8, stop_at_eos=False, **overrides)
    ps = prompts(tokenizer)
    seeds = [11, 12, 13]
    batch = generate(model, ps, config=cfg, row_seeds=seeds)
    for i, p in enumerate(ps):
        alone = generate(model, [p], config=cfg, row_seeds=[seeds[i]])
        assert torch.equal(batch.sequences[i], alone.sequences[0]), i
        assert batch.nfe_per_row[i] == alone.nfe_per_row[0]


def test_seed_reproducible_and_matters(tiny_llada, tokenizer):
    cfg = GenerationConfig(gen_length=16, block_length=8, threshold=None, temperature=1.0, seed=5, stop_at_eos=False)
    a = generate(tiny_llada, prompts(tokenizer), config=cfg).sequences
    b = generate(tiny_llada, prompts(tokenizer), config=cfg).sequences
    c = generate(tiny_llada, prompts(tokenizer), config=cfg.replace(seed=6)).sequences
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_padded_tensor_input_equals_list_input(tiny_llada, tokenizer):
    ps = prompts(tokenizer)
    width = max(map(len, ps))
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros(len(ps), width, dtype=torch.bool)
    for i, p in enumerate(ps):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = True
    cfg = GenerationConfig(gen_length=16, block_length=8, stop_at_eos=False)
    a = generate(tiny_llada, ids, config=cfg, attention_mask=mask)
    b = generate(tiny_llada, ps, config=cfg)
    assert torch.equal(a.sequences, b.sequences)


@pytest.fixture(scope="module")
def trained():
    return fastdllm.load(device="cpu")


def arith_prompts(tokenizer, n):
    from fastdllm.evaluation.tasks import arith
    from fastdllm.evaluation.tasks.arith import prompt_ids

    return [prompt_ids(tokenizer, p.question, []) for p in arith.test_split()[:n]]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        pytest.param(dict(cache="none", threshold=None, suffix_window=None, steps=64), marks=pytest.mark.slow),
        dict(suffix_window=32),
        dict(refresh="vicinity"),
        dict(refresh="vicinity", suffix_window=16, refresh_every=3),
    ],
)
def test_stop_at_eos_gives_the_full_length_text(trained, overrides):
    model, tok = trained
    ps = arith_prompts(tok, 6)
    cfg = GenerationConfig(gen_length=128, block_length=32, **overrides)
    stopped = generate(model, ps, config=cfg)
    full = generate(model, ps, config=cfg.replace(stop_at_eos=False))
    for i in range(len(ps)):
        a, b = stopped.sequences[i].tolist(), full.sequences[i].tolist()
        n = stopped.num_tokens[i]
        assert n == full.num_tokens[i] and a[:n] == b[:n]
        assert tok.decode(a) == tok.decode(b)
    assert stopped.nfe < full.nfe  # the answers end well before 128 tokens: stopping saves work
    assert stopped.nfe_per_row == [sum(1 for _ in t) for t in stopped.tokens_per_step]


@pytest.mark.slow
def test_eos_early_stop_ends_a_block_at_its_stop_token_with_the_same_answer(trained):
    """LLaDA2's eos_early_stop: once a stop token is revealed with every position before it, the row
    stops inside the block; the answer is the same as stopping after the block, in no more steps
    (this model reveals the EOS tail first, so it saves none here: tests/test_moe.py shows the saving)."""
    model, tok = trained
    ps = arith_prompts(tok, 4)
    cfg = GenerationConfig(
        gen_length=64, block_length=32, threshold=None, cache="none", suffix_window=None, refresh="full"
    )  # one token per step: the block's tail is revealed one by one
    after_block = generate(model, ps, config=cfg)
    early = generate(model, ps, config=cfg.replace(eos_early_stop=True))
    for i in range(len(ps)):
        n = after_block.num_tokens[i]
        assert early.num_tokens[i] == n and torch.equal(early.sequences[i, :n], after_block.sequences[i, :n])
        assert set(early.sequences[i, n:].tolist()) <= {model.args.eos_token_id, *model.stop_token_ids}  # no mask left
        assert early.nfe_per_row[i] <= after_block.nfe_per_row[i]
    for i, p in enumerate(ps):  # a row stops in a batch as alone
        alone = generate(model, [p], config=cfg.replace(eos_early_stop=True))
        assert torch.equal(alone.sequences[0], early.sequences[i]) and alone.nfe_per_row == [early.nfe_per_row[i]]
    with pytest.raises(ValueError, match="eos_early_stop"):
        GenerationConfig(eos_early_stop=True, stop_at_eos=False)


def test_step_record_is_consistent(trained):
    model, tok = trained
    out = generate(model, arith_prompts(tok, 4), config=GenerationConfig(gen_length=64, block_length=32))
    for r in range(4):
        steps = out.unmask_step[r]
        revealed = steps[steps >= 0]
        assert len(out.tokens_per_step[r]) == out.nfe_per_row[r]
        counts = torch.bincount(revealed, minlength=out.nfe_per_row[r]).tolist()
        assert counts == out.tokens_per_step[r]
        assert all(c >= 1 for c in counts)
    assert max(out.nfe_per_row) == out.nfe


def test_on_step_and_stream_blocks(trained):
    model, tok = trained
    ps = arith_prompts(tok, 2)
    cfg = GenerationConfig(gen_length=96, block_length=32, stop_at_eos=False)
    events = []
    out = generate(model, ps, config=cfg, on_step=events.append)
    steps = [e for e in events if e.kind == "step"]
    # every row takes part in every step until it leaves: the steps are the longest row's forwards
    assert len(steps) == max(out.nfe_per_row) <= out.nfe
    assert [sum(r in e.rows for e in steps) for r in range(2)] == out.nfe_per_row
    assert sum(int(e.revealed.sum()) for e in steps) == 2 * 96
    blocks = list(stream_blocks(model, ps, cfg))
    for r in range(2):  # each row's blocks in order, each once, as it became final
        assert [b for b, parts, _ in blocks if parts[r]] == [0, 1, 2]
    for r in range(2):
        assert sum((parts[r] for _, parts, _ in blocks), []) == out.sequences[r].tolist()


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(gen_length=0), "gen_length"),
        (dict(gen_length=100, block_length=32), "block_length"),
        (dict(gen_length=64, block_length=32, steps=1), "steps"),
        (dict(gen_length=64, steps=65), "steps"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(factor=0), "factor"),
        (dict(temperature=-1), "temperature"),
        (dict(remasking="lowest"), "remasking"),
        (dict(cache="triple"), "cache"),
        (dict(alg="greedy"), "alg"),
        (dict(alg_temp=-0.1), "alg_temp"),
        (dict(eps=0), "eps"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(stop_at_eos="yes"), "stop_at_eos"),
        (dict(gen_length="64"), "gen_length"),
    ],
)
def test_invalid_config_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        GenerationConfig(**kwargs)


def test_invalid_inputs_are_clear(tiny_llada, tokenizer):
    cfg = GenerationConfig(gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="input_ids: empty prompt"):
        generate(tiny_llada, [[]], config=cfg)
    with pytest.raises(ValueError, match="mask token"):
        generate(tiny_llada, [[5, tiny_llada.mask_token_id, 7]], config=cfg)
    with pytest.raises(ValueError, match="max_sequence_length"):
        generate(tiny_llada, [[5] * 2040], config=cfg)
    with pytest.raises(ValueError, match="left-padded"):
        generate(
            tiny_llada, torch.ones(1, 4, dtype=torch.long), config=cfg, attention_mask=torch.tensor([[1, 1, 1, 0]])
        )


# ---- fidelity to the reference implementations ------------------------------------------------------
def test_llada_ranks_confidences_in_float64():
    """Two near-certain positions whose probabilities tie in float32 are ordered by their float64
    values, as the reference's float64 softmax orders them (not leftmost-first)."""
    logits = torch.full((1, 2, 4), 0.0)
    logits[0, 0, 1], logits[0, 1, 2] = 20.0, 20.5  # p = 1 - 6.2e-9 and 1 - 3.7e-9
    p32 = logits.softmax(-1).amax(-1)
    assert p32[0, 0] == p32[0, 1]  # the collision is real in float32
    config = GenerationConfig.baseline(gen_length=2, block_length=2)
    strategy = UnmaskingStrategy.from_config(config)
    tokens, conf = strategy.propose(logits, None, [None])
    assert conf.dtype == torch.float64 and conf[0, 1] > conf[0, 0]
    rule = strategy.new_rule()
    masked = torch.ones(1, 2, dtype=torch.bool)
    assert rule.select(conf, masked, BlockClock.uniform(masked, 2), None, [0]).tolist() == [[False, True]]


def test_llada_confidence_is_the_references_softmax_not_its_logsumexp_form():
    """Two near-certain positions that exp(logit - logsumexp) rounds to an equal 1.0 (ties go to
    the leftmost) while the reference's float64 softmax gives 0.999999999999998 and
    0.9999999999999998: the reference reveals the right one, and so must we."""
    logits = torch.tensor(
        [
            [
                [42.29401779174805, -1.7616678476333618, 8.496312141418457, 2.711992025375366],
                [41.0862922668457, -0.8251047730445862, 2.65976881980896, 4.4572248458862305],
            ]
        ]
    )
    logsumexp_form = (logits[..., 0].double() - logits.double().logsumexp(-1)).exp()
    assert logsumexp_form[0, 0] == logsumexp_form[0, 1]  # the two forms really part here
    config = GenerationConfig.baseline(gen_length=2, block_length=2)
    strategy = UnmaskingStrategy.from_config(config)
    tokens, conf = strategy.propose(logits, None, [None])
    assert torch.equal(conf, torch.softmax(logits.double(), -1)[..., 0]) and conf[0, 1] > conf[0, 0]
    rule = strategy.new_rule()
    masked = torch.ones(1, 2, dtype=torch.bool)
    assert rule.select(conf, masked, BlockClock.uniform(masked, 2), None, [0]).tolist() == [[False, True]]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_dream_with_a_cache_reveals_the_blocks_first_position_at_block_start(tiny_dream, tiny_llada, tokenizer, cache):
    """Fast-dLLM's Dream: the block-start forward reveals exactly the block's first position,
    whatever the rule; LLaDA, and Dream without a cache, apply the rule there too."""
    # two steps per block: a schedule reveals several positions at each
    config = GenerationConfig(gen_length=32, block_length=8, steps=8, threshold=None, cache=cache, stop_at_eos=False)

    def first_steps(model, cfg):
        seen, out = set(), []

        def on_step(event):
            if event.block not in seen:
                seen.add(event.block)
                out.append(event.chosen[0].tolist())

        generate(model, prompts(tokenizer)[:1], config=cfg, on_step=on_step)
        return out

    for dream_config in (config.replace(alg="maskgit_plus"), config.replace(threshold=0.05)):
        dream = first_steps(tiny_dream, dream_config)
        assert len(dream) == 4 and all(c == [True] + [False] * 7 for c in dream), dream
    assert all(sum(c) == 3 for c in first_steps(tiny_dream, config.replace(alg="maskgit_plus", cache="none")))
    assert all(sum(c) == 4 for c in first_steps(tiny_llada, config))


# ---- work accounting -------------------------------------------------------------------------------
def test_work_accounting_on_hand_checkable_cases(tiny_llada, tokenizer):
    prompt = prompts(tokenizer)[:1]
    plen, gen, blk = len(prompt[0]), 32, 8
    length = plen + gen
    base = dict(gen_length=gen, block_length=blk, stop_at_eos=False)
    # the baseline: every forward is the whole sequence, one per token
    out = generate(tiny_llada, prompt, config=GenerationConfig.baseline(**base))
    assert out.nfe == gen and out.forward_positions == [gen * length]
    assert out.attended_positions == [gen * length * length]
    assert out.positions_per_token == gen * length / out.num_tokens[0]
    assert out.prompt_positions == [plen]
    assert out.decode_positions_per_token == (gen * length - plen) / out.num_tokens[0]
    # DualCache, one token per step: per block one full forward, then block-sized windows
    out = generate(tiny_llada, prompt, config=GenerationConfig.fast_dllm(threshold=None, cache="dual", **base))
    per_block = blk  # steps per block
    assert out.forward_positions == [(gen // blk) * (length + (per_block - 1) * blk)]
    # prefix cache: the window runs from the block to the end of the sequence
    out = generate(tiny_llada, prompt, config=GenerationConfig.fast_dllm(threshold=None, cache="prefix", **base))
    expected = sum(length + (per_block - 1) * (length - (plen + b * blk)) for b in range(gen // blk))
    assert out.forward_positions == [expected]


def test_work_is_charged_per_row_as_alone(tiny_llada, tokenizer):
    cfg = GenerationConfig.fast_dllm(gen_length=32, block_length=8, threshold=0.5, stop_at_eos=False)
    rows = prompts(tokenizer)[:3]
    together = generate(tiny_llada, rows, config=cfg)
    for i, p in enumerate(rows):
        alone = generate(tiny_llada, [p], config=cfg)
        if len(p) == max(len(r) for r in rows):  # same padded length: the same windows
            assert together.forward_positions[i] == alone.forward_positions[0]
        assert together.nfe_per_row[i] == alone.nfe_per_row[0]


# ---- beyond Fast-dLLM: suffix window, vicinity refresh ------------------------------------------------
@pytest.mark.parametrize("arch", ["tiny_llada", "tiny_dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_conservative_settings_are_token_identical_to_fast_dllm(arch, cache, request, tokenizer):
    model = request.getfixturevalue(arch)
    base = GenerationConfig.fast_dllm(gen_length=32, block_length=8, threshold=0.3, cache=cache, stop_at_eos=False)
    ref = generate(model, prompts(tokenizer), config=base)
    variants = [base.replace(suffix_window=32), base.replace(suffix_window=1000)]
    if cache != "none":
        variants.append(base.replace(refresh="vicinity", refresh_every=1))
    for cfg in variants:
        out = generate(model, prompts(tokenizer), config=cfg)
        assert torch.equal(out.sequences, ref.sequences), cfg
        assert out.nfe_per_row == ref.nfe_per_row and out.forward_positions == ref.forward_positions


@pytest.mark.parametrize(
    "overrides",
    [dict(suffix_window=8), dict(refresh="vicinity"), dict(refresh="vicinity", suffix_window=4, cache="prefix")],
)
def test_new_policies_batch_equals_single(tiny_llada, tokenizer, overrides):
    cfg = GenerationConfig.fast_dllm(gen_length=32, block_length=8, threshold=0.3, stop_at_eos=False, **overrides)
    a, b = tokenizer.encode("Tom has 5 apples and 3 pears."), tokenizer.encode("Mia has 4 cats.")
    same_length = [a[: len(b)], b] if len(a) >= len(b) else [a, b[: len(a)]]
    together = generate(tiny_llada, same_length, config=cfg)
    for i, p in enumerate(same_length):
        alone = generate(tiny_llada, [p], config=cfg)
        assert torch.equal(together.sequences[i], alone.sequences[0])
        assert together.forward_positions[i] == alone.forward_positions[0]


def test_new_policies_compute_less(tiny_llada, tokenizer):
    base = GenerationConfig.fast_dllm(gen_length=64, block_length=8, threshold=None, cache="dual", stop_at_eos=False)
    ps = prompts(tokenizer)[:1]
    plen, length = len(ps[0]), len(ps[0]) + 64
    full = generate(tiny_llada, ps, config=base)
    near = generate(tiny_llada, ps, config=base.replace(refresh="vicinity"))
    window = generate(tiny_llada, ps, config=base.replace(suffix_window=8))
    # block b > 0 starts with a forward from the previous block on, not over the whole sequence
    expected = length + sum(length - (plen + (b - 1) * 8) for b in range(1, 8)) + 8 * 7 * 8
    assert near.forward_positions == [expected] and expected < full.forward_positions[0]
    # every forward sees at most the block and 8 positions after it
    assert window.attended_positions[0] < full.attended_positions[0]
    assert not (near.sequences == tiny_llada.mask_token_id).any()
    assert not (window.sequences == tiny_llada.mask_token_id).any()


def test_vicinity_refresh_keeps_cache_rows_when_rows_finish(trained):
    """Rows that finish leave the batch; with a vicinity refresh the others' cached K/V move with
    them, so each row still decodes as alone."""
    model, tok = trained
    ps = arith_prompts(tok, 4)
    cfg = GenerationConfig.fast_dllm(gen_length=128, block_length=32, refresh="vicinity")
    together = generate(model, ps, config=cfg)
    assert len(set(together.nfe_per_row)) > 1  # rows finished at different blocks
    for i, p in enumerate(ps):
        alone = generate(model, [p], config=cfg)
        n = alone.num_tokens[0]
        assert together.sequences[i, :n].tolist() == alone.sequences[0, :n].tolist()


def test_adaptive_refresh(trained, tiny_llada, tokenizer):
    base = GenerationConfig.fast_dllm(gen_length=32, block_length=8, threshold=0.3, stop_at_eos=False)
    ref = generate(tiny_llada, prompts(tokenizer), config=base)
    # tolerance 0: every row refreshes fully after the vicinity forward: Fast-dLLM's tokens
    always = generate(tiny_llada, prompts(tokenizer), config=base.replace(refresh="adaptive", refresh_tol=0.0))
    assert torch.equal(always.sequences, ref.sequences)
    assert all(a > r for a, r in zip(always.nfe_per_row, ref.nfe_per_row))  # the extra forwards are counted
    # an infinite tolerance never refreshes: the vicinity refresh's tokens
    never = generate(tiny_llada, prompts(tokenizer), config=base.replace(refresh="adaptive", refresh_tol=1e9))
    near = generate(tiny_llada, prompts(tokenizer), config=base.replace(refresh="vicinity"))
    assert torch.equal(never.sequences, near.sequences) and never.forward_positions == near.forward_positions
    # per row: a batch decodes as its rows alone
    model, tok = trained
    ps = arith_prompts(tok, 4)
    cfg = GenerationConfig.fast_dllm(
        gen_length=128, block_length=32, refresh="adaptive", refresh_tol=0.05, stop_at_eos=False
    )
    together = generate(model, ps, config=cfg)
    for i, p in enumerate(ps):
        alone = generate(model, [p], config=cfg)
        n = alone.num_tokens[0]
        assert together.sequences[i, :n].tolist() == alone.sequences[0, :n].tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        dict(cache="dual", threshold=0.5),
        dict(cache="prefix", threshold=0.5, suffix_window=8, refresh="vicinity"),
        dict(cache="none", threshold=None),
    ],
)
def test_compiled_layers_decode_the_same_tokens(tiny_llada, tokenizer, policy):
    """compile=True runs the layers through torch.compile (dynamic shapes): the same tokens as eager,
    for windows of every width, padded rows and a second answer length without recompiling."""
    base = GenerationConfig(gen_length=32, block_length=8, stop_at_eos=False, **policy)
    for cfg in (base, base.replace(gen_length=48)):
        eager = generate(tiny_llada, prompts(tokenizer), cfg)
        compiled = generate(tiny_llada, prompts(tokenizer), cfg.replace(compile=True))
        assert torch.equal(compiled.sequences, eager.sequences)
        assert compiled.nfe_per_row == eager.nfe_per_row


def test_a_model_that_ranks_the_mask_first_still_reveals_every_position(tiny_llada, tokenizer, monkeypatch):
    head = tiny_llada.head

    def mask_first(h):
        out = head(h)
        out[..., tiny_llada.mask_token_id] += 1e4
        return out

    monkeypatch.setattr(tiny_llada, "head", mask_first)
    config = GenerationConfig(gen_length=16, block_length=8, threshold=None, cache="none", stop_at_eos=False)
    out = generate(tiny_llada, prompts(tokenizer)[:1], config=config)
    assert not (out.sequences == tiny_llada.mask_token_id).any() and out.nfe == 16


def test_only_the_row_that_proposed_the_mask_draws_again():
    """Sampled decoding: a row that proposes [MASK] proposes again from its own stream; the other
    rows of its batch draw nothing more, so each decides as alone."""
    from fastdllm.engine.decode import BlockClock

    config = GenerationConfig(
        gen_length=8, block_length=8, threshold=None, temperature=0.7, alg="entropy", alg_temp=0.3, stop_at_eos=False
    )
    strategy = UnmaskingStrategy.from_config(config)
    vocab, mask = 50, 7
    logits = torch.randn(2, 8, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, :, mask] += 100  # row 1 ranks [MASK] first everywhere
    block = torch.full((2, 8), mask)

    def clock(n):
        return BlockClock([0] * n, [8] * n, torch.full((n,), 8))

    together = [torch.Generator().manual_seed(s) for s in (1, 2)]
    both = strategy.decide(logits, DecodeView(block, clock(2), mask, together))
    alone = [torch.Generator().manual_seed(1)]
    first = strategy.decide(logits[:1], DecodeView(block[:1], clock(1), mask, alone))
    assert torch.equal(both.tokens[0], first.tokens[0]) and torch.equal(both.chosen[0], first.chosen[0])
    assert torch.equal(together[0].get_state(), alone[0].get_state())
    assert not (both.tokens[1] == mask).any()
