"""A new policy is one class and one registry entry: a refresh rule and a selection rule defined
here, outside the package, run by name through every entry point (generate, stream_blocks,
evaluate, the server's scheduler); and the policies the config names are built in one place."""

from __future__ import annotations

import asyncio

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.config import REFRESH_RULES, ConfigError, register_preset, selection_rule_name
from fastdllm.engine.cache.refresh import VicinityRefresh, register_refresh_rule
from fastdllm.engine.decode import (
    Decision,
    Decoder,
    DreamSchedule,
    Factor,
    FirstPositionAtBlockStart,
    LinearSchedule,
    SelectionRule,
    Threshold,
    register_decoder,
    register_selection_rule,
)
from fastdllm.engine.decode.rules import _top_k_mask
from fastdllm.engine.policies import Policies, policies_for
from fastdllm.engine.registry import SELECTION_RULES
from fastdllm.evaluation import harness as evaluate_module
from fastdllm.evaluation.tasks import arith

CONSULTED: list[int] = []


class CountingVicinity(VicinityRefresh):
    """The vicinity refresh, noting each block it is asked about."""

    name = "test_counting_vicinity"

    def needs_full(self, block):
        CONSULTED.append(block)
        return super().needs_full(block)


class TwoLeftmost(SelectionRule):
    """Reveals the two leftmost masked positions at every step, whatever the confidence."""

    name = "test_two_leftmost"

    def select(self, conf, masked, step, generators, rows):
        left = torch.arange(masked.shape[1], 0, -1, device=masked.device).expand_as(masked).float()
        return (
            _top_k_mask(
                left.masked_fill(~masked, float("-inf")), torch.full((masked.shape[0],), 2, device=masked.device)
            )
            & masked
        )


register_refresh_rule(CountingVicinity)
register_selection_rule(TwoLeftmost)
TOY = GenerationConfig(
    gen_length=64, block_length=16, refresh=CountingVicinity.name, unmasking=TwoLeftmost.name, stop_at_eos=False
)


@pytest.fixture(scope="module")
def model():
    return fastdllm.load(dtype="float32")


def check_toy(tokens_per_step, unmask_step):
    assert all(n == 2 for n in tokens_per_step), tokens_per_step
    assert unmask_step.tolist() == [i // 2 for i in range(64)]  # left to right, two at a time


def test_the_toy_rules_run_through_generate_and_stream_blocks(model):
    m, tok = model
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:2]]
    CONSULTED.clear()
    out = fastdllm.generate(m, ids, config=TOY)
    assert CONSULTED and set(CONSULTED) == {0, 1, 2, 3}
    for row in range(2):
        check_toy(out.tokens_per_step[row], out.unmask_step[row])
    # the toy refresh rule decodes as the built-in vicinity refresh it extends
    same = fastdllm.generate(m, ids, config=TOY.replace(refresh="vicinity"))
    assert torch.equal(same.sequences, out.sequences)
    CONSULTED.clear()
    streamed = [b for _, b, _ in fastdllm.stream_blocks(m, ids, config=TOY)]
    assert CONSULTED and [t for b in streamed for t in b[0]] == out.sequences[0].tolist()


def test_the_toy_rules_run_through_evaluate(model):
    m, tok = model
    CONSULTED.clear()
    r = evaluate_module.evaluate(m, tok, "arith", limit=3, config=TOY)
    assert CONSULTED and r["tokens_per_step"] == 2.0 and r["nfe_per_sample"] == 32


def test_the_toy_rules_run_through_the_servers_scheduler(model):
    from fastdllm.server import Job, Scheduler
    from fastdllm.server.scheduler import BlockFinal, JobEnded, JobFailed

    m, tok = model
    ids = [arith.prompt_ids(tok, arith.test_split()[0].question, [])]
    ref = fastdllm.generate(m, ids, config=TOY.replace(seed=3))

    async def scenario():
        sched = Scheduler(m)
        job = Job(ids, [3], TOY, asyncio.get_running_loop())
        sched.submit(job)
        items = []
        while not items or not isinstance(items[-1], (JobEnded, JobFailed)):
            items.append(await asyncio.wait_for(job.events.get(), 120))
        sched.close()
        return items

    CONSULTED.clear()
    items = asyncio.run(scenario())
    assert items[-1] == JobEnded() and CONSULTED
    assert [t for item in items if isinstance(item, BlockFinal) for t in item.tokens[0]] == ref.sequences[0].tolist()


def test_a_bundle_of_policy_objects_is_accepted_everywhere(model):
    m, tok = model
    ids = [arith.prompt_ids(tok, arith.test_split()[1].question, [])]
    cfg = GenerationConfig(gen_length=64, block_length=16, stop_at_eos=False)
    ref = fastdllm.generate(m, ids, config=cfg)
    made = []

    def factory(model_, config):
        made.append(config)
        return policies_for(model_, config)

    assert torch.equal(fastdllm.generate(m, ids, config=cfg, policies=factory).sequences, ref.sequences)
    bundle = policies_for(m, cfg)
    assert isinstance(bundle, Policies)
    assert torch.equal(fastdllm.generate(m, ids, config=cfg, policies=bundle).sequences, ref.sequences)
    streamed = [t for _, b, _ in fastdllm.stream_blocks(m, ids, config=cfg, policies=factory) for t in b[0]]
    assert streamed == ref.sequences[0].tolist() and len(made) == 2


def test_the_precedence_is_stated_once():
    assert selection_rule_name(GenerationConfig(factor=1.0, threshold=0.9)) == "factor"
    assert selection_rule_name(GenerationConfig(threshold=0.9)) == "threshold"
    assert selection_rule_name(GenerationConfig(threshold=None)) == "linear"
    assert selection_rule_name(GenerationConfig(threshold=None, alg="entropy")) == "dream_schedule"
    assert selection_rule_name(GenerationConfig(unmasking="linear", threshold=0.9)) == "linear"
    assert {
        n: type(SELECTION_RULES[n].from_config(GenerationConfig(factor=1.0, alg="origin")))
        for n in ("threshold", "factor", "linear", "dream_schedule")
    } == {"threshold": Threshold, "factor": Factor, "linear": LinearSchedule, "dream_schedule": DreamSchedule}
    with pytest.raises(ConfigError) as info:
        GenerationConfig(unmasking="no_such_rule")
    assert info.value.param == "unmasking"
    with pytest.raises(ConfigError) as info:
        GenerationConfig(unmasking="factor")  # no factor given
    assert info.value.param == "factor"
    assert "test_counting_vicinity" in REFRESH_RULES


def test_the_family_contributes_its_block_start_rule(model):
    dream, _ = fastdllm.load("dream-arith", dtype="float32")
    llada, _ = model
    cached, uncached = GenerationConfig(), GenerationConfig(cache="none")
    assert isinstance(policies_for(dream, cached).strategy.new_rule(), FirstPositionAtBlockStart)
    assert not isinstance(policies_for(dream, uncached).strategy.new_rule(), FirstPositionAtBlockStart)
    assert not isinstance(policies_for(llada, cached).strategy.new_rule(), FirstPositionAtBlockStart)


def test_a_partial_bundle_takes_the_rest_from_the_config(model):
    """`policies=` is the one way to hand objects in: a field left None is the config's own, and
    `cache=` is then only the config's field (a name), as transformers-style options are."""
    m, tok = model
    ids = [arith.prompt_ids(tok, arith.test_split()[2].question, [])]
    cfg = GenerationConfig(gen_length=64, block_length=16, stop_at_eos=False)
    ref = fastdllm.generate(m, ids, config=cfg)
    whole = policies_for(m, cfg)
    only_cache = fastdllm.generate(m, ids, config=cfg, policies=Policies(cache=whole.cache))
    assert torch.equal(only_cache.sequences, ref.sequences)
    named = fastdllm.generate(m, ids, config=cfg, cache="prefix")
    assert named.config.cache == "prefix"
    with pytest.raises(ValueError, match="policies"):
        fastdllm.generate(m, ids, config=cfg, policies=lambda model, config: "not a bundle")


def test_a_confidence_temperature_tempers_confidences_not_tokens(model):
    from fastdllm.engine.decode import UnmaskingStrategy

    torch.manual_seed(0)
    logits = torch.randn(2, 8, 50) * 4
    plain = UnmaskingStrategy.from_config(GenerationConfig())
    tempered = UnmaskingStrategy.from_config(GenerationConfig(confidence_temperature=3.0))
    (t1, c1), (t3, c3) = plain.propose(logits, None, [0, 1]), tempered.propose(logits, None, [0, 1])
    assert torch.equal(t1, t3) and (c3 < c1).all()
    m, tok = model
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:4]]

    def per_step(t):
        out = fastdllm.generate(m, ids, config=GenerationConfig(gen_length=64, confidence_temperature=t))
        return sum(map(sum, out.tokens_per_step)) / sum(map(len, out.tokens_per_step))

    assert per_step(1.0) > per_step(2.0) >= 1.0
    with pytest.raises(ConfigError, match="confidence_temperature: needs greedy"):
        GenerationConfig(confidence_temperature=2.0, temperature=0.5)
    with pytest.raises(ConfigError, match="confidence_temperature"):
        GenerationConfig(confidence_temperature=0.0)


class LeftmostArgmax(SelectionRule):
    """Names the toy decoder below (`unmasking="test_leftmost_argmax"`)."""

    name = "test_leftmost_argmax"


@register_decoder(LeftmostArgmax.name)
class LeftmostDecoder(Decoder):
    """A whole decoder in a few lines (docs/decoding.md's example): greedy, one position a step, the
    leftmost mask taking its argmax."""

    @classmethod
    def from_config(cls, config, model=None, cache=None):
        return cls()

    def decide(self, logits, view):
        masked = view.block == view.mask_id
        chosen = masked & (masked.long().cumsum(-1) == 1)
        return Decision(logits.argmax(-1), chosen)


register_selection_rule(LeftmostArgmax)
register_preset("test-leftmost", dict(unmasking=LeftmostArgmax.name, cache="none", threshold=None))


def test_a_decoder_is_one_class_that_the_loop_never_names(model):
    """A decoder registered for its rule decodes by name through generate, and in one batch with
    rows of another decoder each row decodes as alone (their decisions merged by the loop)."""
    from fastdllm.engine.decoder import BlockDecoder

    m, tok = model
    ids = [arith.prompt_ids(tok, p.question, []) for p in arith.test_split()[:2]]
    toy = GenerationConfig(gen_length=32, block_length=16, unmasking=LeftmostArgmax.name, stop_at_eos=False)
    out = fastdllm.generate(m, ids, config=toy)
    assert out.unmask_step[0].tolist() == list(range(32)) and out.nfe == 32
    with torch.no_grad():  # its first token: the argmax of the first forward (the whole row)
        logits = m(torch.tensor([ids[0] + [m.mask_token_id] * 32]))
    assert int(logits[0, len(ids[0])].argmax()) == out.sequences[0, 0]
    plain = toy.replace(unmasking=None)
    decoder = BlockDecoder(m, toy)
    rows = [decoder.add([ids[0]], config=toy)[0], decoder.add([ids[1]], config=plain)[0]]
    while decoder.active:
        decoder.step()
    assert torch.equal(rows[0].answer, out.sequences[0])
    assert torch.equal(rows[1].answer, fastdllm.generate(m, [ids[1]], config=plain).sequences[0])
    assert rows[1].nfe < rows[0].nfe  # the other decoder really decided its own row
    # its preset, declared beside it, by name in Python and on the command line
    preset = GenerationConfig.preset("test-leftmost", gen_length=32, block_length=16)
    assert preset.unmasking == LeftmostArgmax.name and preset.cache == "none"
    assert torch.equal(
        fastdllm.generate(m, ids[:1], config=preset.replace(stop_at_eos=False)).sequences, out.sequences[:1]
    )
    from fastdllm.cli.main import main as cli

    assert cli(["generate", "--preset", "test-leftmost", "--gen-length", "32", "--no-stats", "Question: 1 + 2?"]) == 0
