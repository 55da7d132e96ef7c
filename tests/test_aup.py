"""AUP against d3LLM's published leaderboard, and the entropy rule (dParallel) on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from fastdllm import GenerationConfig
from fastdllm.engine.decode import BlockClock, DecodeView, EntropyThreshold, UnmaskingStrategy
from fastdllm.evaluation.aup import aup

# d3LLM's AUP_leaderboard/data_llada.yaml, GSM8K-CoT, and the AUP its README reports for each
GSM8K_COT = {
    "LLaDA": ([1.0], [72.55], 72.55),
    "Fast-dLLM-LLaDA": ([1.0, 2.77], [74.79, 74.68], 205.78),
    "D2F": ([1.0, 2.88], [74.98, 74.39], 213.76),
    "dParallel-LLaDA": ([1.0, 5.14], [74.0, 72.63], 358.14),
    "d3LLM-LLaDA": ([1.0, 9.11], [74.02, 73.09], 637.65),
}


@pytest.mark.parametrize("method", sorted(GSM8K_COT))
def test_aup_reproduces_d3llms_table(method):
    y_max = max(a for _, ys, _ in GSM8K_COT.values() for a in ys)
    assert y_max == 74.98
    rho, y, published = GSM8K_COT[method]
    assert round(aup(rho, y, y_max), 2) == published


def test_aup_keeps_points_within_five_points_and_weights_losses():
    assert aup([1.0, 4.0], [80.0, 70.0], 80.0) == 80.0  # the second point lost 10 points: dropped
    lossless = aup([1.0, 3.0], [80.0, 80.0], 80.0)
    assert lossless == 80.0 + 2 * 80.0
    assert aup([1.0, 3.0], [80.0, 78.0], 80.0) < lossless - 2 * 2  # weighted below the plain area
    assert aup([3.0, 1.0], [80.0, 80.0], 80.0) == lossless  # order does not matter
    for bad in (([], []), ([1.0], [0.9, 0.8]), ([0.0], [80.0])):
        with pytest.raises(ValueError, match="^rho: "):
            aup(*bad, 80.0)
    with pytest.raises(ValueError, match="^y_max: "):
        aup([1.0], [0.0], 0.0)


def _entropy(p):
    return -sum(x * math.log(x + 1e-12) for x in p)


def test_entropy_rule_reveals_low_entropy_positions_and_always_the_lowest():
    # three positions, vocabulary of 4: their entropies 0.17, 0.56, 1.39 nats
    probs = torch.tensor([[[0.97, 0.01, 0.01, 0.01], [0.85, 0.05, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25]]])
    logits = torch.cat([probs.log(), torch.full((1, 3, 1), float("-inf"))], -1)  # token 4: the mask
    block = torch.full((1, 3), 4)
    clock = BlockClock.uniform(block == 4, 3)
    entropies = [_entropy(p.tolist()) for p in probs[0]]
    assert entropies[0] < 0.5 < entropies[1] < 1.0 < entropies[2]
    for threshold, want in ((0.5, [True, False, False]), (1.0, [True, True, False]), (0.01, [True, False, False])):
        config = GenerationConfig(unmasking="entropy", threshold=threshold)
        strategy = UnmaskingStrategy.from_config(config)
        d = strategy.decide(logits, DecodeView(block, clock, 4))
        assert d.chosen[0].tolist() == want, threshold
    # only the masked positions count: the lowest-entropy one among them is always revealed
    block[0, 0] = 5
    d = UnmaskingStrategy.from_config(GenerationConfig(unmasking="entropy", threshold=0.01)).decide(
        logits, DecodeView(block, clock, 4)
    )
    assert d.chosen[0].tolist() == [False, True, False]


def test_entropy_rule_forms_and_threshold():
    assert GenerationConfig(unmasking="entropy", threshold=2.5).threshold == 2.5  # nats: above 1 allowed
    with pytest.raises(ValueError, match="^threshold: "):
        GenerationConfig(threshold=2.5)
    with pytest.raises(ValueError, match="^threshold: "):
        GenerationConfig(unmasking="entropy", threshold=None)
    rule = EntropyThreshold.from_config(GenerationConfig(unmasking="entropy", threshold=0.5, alg="entropy"))
    assert rule.strict  # Dream's form: strictly below
    conf = torch.tensor([[-0.5, -0.2]])
    masked = torch.tensor([[True, True]])
    clock = BlockClock.uniform(masked, 1)
    assert rule.select(conf, masked, clock, None, None).tolist() == [[False, True]]
    loose = EntropyThreshold(0.5)
    assert loose.select(conf, masked, clock, None, None).tolist() == [[True, True]]
    d = GenerationConfig.dparallel()
    assert (d.unmasking, d.threshold, d.cache, d.block_length) == ("entropy", 0.5, "none", 32)
    assert GenerationConfig.preset("dparallel") == d


def test_a_checkpoint_named_for_dparallel_decodes_as_dparallel(tiny_llada, tiny_llada_dir, tokenizer, tmp_path, capsys):
    import json

    import fastdllm
    from fastdllm.cli.main import main as cli
    from fastdllm.models.loading import save_pretrained

    folder = save_pretrained(tiny_llada, tmp_path / "dParallel-LLaDA-tiny", tokenizer, dtype=torch.float32)
    model, _ = fastdllm.load(folder)
    assert model.decoding == "dparallel" and fastdllm.load(tiny_llada_dir)[0].decoding is None
    assert GenerationConfig.for_model(model, checkpoint_defaults=False) == GenerationConfig.dparallel().fit_to_model(
        model
    )
    argv = ["generate", "--model", str(folder), "--json", "--raw", "--gen-length", "32", "hi"]
    assert cli(argv) == 0
    out = capsys.readouterr()
    config = json.loads(out.out)["config"]
    assert (config["unmasking"], config["threshold"], config["gen_length"]) == ("entropy", 0.5, 32)
    assert "--preset dparallel" in out.err
    assert cli([*argv, "--preset", "default"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["unmasking"] is None


def test_d3llms_later_blocks_take_their_sure_positions_and_the_lowest_overall():
    from fastdllm.engine.decode import EntropyLookahead, lookahead_for

    assert isinstance(lookahead_for(GenerationConfig.d3llm()), EntropyLookahead)
    rule = EntropyLookahead(depth=3, add=0.5, activate=0.95, threshold=0.5)
    current = torch.tensor([[False, False, True, True]])  # half revealed: block 1 takes part, block 2 not
    current_conf = torch.tensor([[-0.1, -0.1, -0.9, -0.8]])  # its masked ones: entropies 0.9 and 0.8
    masked = torch.ones(1, 8, dtype=torch.bool)
    conf = torch.tensor([[-0.4, -0.7, -0.6, -2.0, -0.01, -0.01, -0.01, -0.01]])
    # block 1: its position of entropy 0.4 (at most 0.5); block 2 waits for block 1
    assert rule.select(conf, masked, current, current_conf).tolist() == [[True] + [False] * 7]
    conf = torch.tensor([[-0.7, -0.6, -0.9, -2.0, -0.01, -0.01, -0.01, -0.01]])
    # nothing sure in block 1, but its 0.6 is lower than the current block's lowest (0.8): revealed
    assert rule.select(conf, masked, current, current_conf).tolist() == [[False, True] + [False] * 6]
    sure_here = torch.tensor([[-0.1, -0.1, -0.3, -0.8]])
    assert not rule.select(conf, masked, current, sure_here).any()  # the lowest is the current block's
    # d3LLM's Dream code keeps no lowest across blocks: block 1 reveals only what is sure
    dream = EntropyLookahead(depth=3, add=0.5, activate=0.95, threshold=0.5, keeps_lowest=False)
    assert not dream.select(conf, masked, current, current_conf).any()
    d = GenerationConfig.d3llm()
    assert (d.unmasking, d.threshold, d.block_add_threshold, d.parallel_blocks, d.cache, d.eos_early_stop) == (
        "entropy",
        0.5,
        0.1,
        8,
        "none",
        True,
    )
