"""RND1 as a user meets it: a checkpoint in its layout loads, is recognised, and decodes with its
published sampler by default (`GenerationConfig.rnd1`) from Python, the CLI and the server; the
answer is one block whatever its length. Token parity with RND1's own code is
`tests/test_reference.py::test_rnd1_decodes_as_its_published_sampler`."""

from __future__ import annotations

import json

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.cli.main import main as cli
from fastdllm.models.loading import save_pretrained


@pytest.fixture(scope="module")
def rnd1_dir(tmp_path_factory, tiny_rnd1, tokenizer):
    return save_pretrained(tiny_rnd1, tmp_path_factory.mktemp("rnd1"), tokenizer, dtype=torch.float32)


def test_a_checkpoint_loads_and_decodes_with_its_published_sampler(rnd1_dir, tiny_rnd1):
    model, tok = fastdllm.load(str(rnd1_dir), dtype="float32")
    assert model.family.name == "RND1" and model.decoding == "rnd1"
    for name, p in tiny_rnd1.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name
    config = GenerationConfig.for_model(model, gen_length=24)
    assert (config.unmasking, config.cache, config.block_length, config.temperature) == ("rnd1", "none", 24, 0.01)
    ids = tok.encode("Question: 3 + 4 = ?")
    out = fastdllm.generate(model, [ids], config=config.replace(seed=3))
    again = fastdllm.generate(model, [ids], config=config.replace(seed=3))
    assert out.sequences.tolist() == again.sequences.tolist()  # the seed decides the draws
    assert out.nfe == 24  # one step per answer position
    # greedy: the same answer in a batch as alone, one block of any length
    greedy = config.replace(temperature=0.0, stop_at_eos=False)
    alone = fastdllm.generate(model, [ids], config=greedy)
    batch = fastdllm.generate(model, [ids, tok.encode("Question: 1 + 1 = ?")], config=greedy)
    assert batch.sequences[0].tolist() == alone.sequences[0].tolist()
    # sampled: each row draws over its own sequence from its own generator, in a batch as alone
    prompts = [ids, tok.encode("Question: what is 12 + 30? Answer:")]
    sampled = config.replace(temperature=0.8, stop_at_eos=False)
    batch = fastdllm.generate(model, prompts, config=sampled, row_seeds=[4, 9])
    for i, seed in enumerate((4, 9)):
        alone = fastdllm.generate(model, [prompts[i]], config=sampled.replace(seed=seed))
        assert batch.sequences[i].tolist() == alone.sequences[0].tolist()


def test_the_answer_stays_one_block_whatever_its_length():
    config = GenerationConfig.rnd1()
    assert (config.gen_length, config.block_length) == (256, 256)
    assert config.replace(gen_length=40).block_length == 40
    short = config.with_max_new_tokens(10)
    assert (short.gen_length, short.block_length) == (10, 10)
    # more steps than masks is RND1's own slow schedule; other rules keep the usual bound
    assert GenerationConfig.rnd1(gen_length=12, steps=30).steps == 30
    with pytest.raises(ValueError, match="steps"):
        GenerationConfig(gen_length=32, block_length=32, steps=40)
    # a block length given with the length is kept
    assert config.replace(gen_length=64, block_length=32).block_length == 32


def test_a_pad_outside_the_vocabulary_is_refused_by_name(tiny_rnd1, tokenizer):
    model = tiny_rnd1
    saved = dict(model.config)
    model.config["pad_token_id"] = model.args.vocab_size + 5
    try:
        with pytest.raises(ValueError, match="pad_token_id"):
            fastdllm.generate(model, [tokenizer.encode("hi")], config=GenerationConfig.rnd1(gen_length=8))
    finally:
        model.config.clear()
        model.config.update(saved)


def test_the_cli_decodes_it_with_its_own_preset(rnd1_dir, capsys):
    assert cli(["generate", "--model", str(rnd1_dir), "--gen-length", "16", "--json", "Question: 2 + 2?"]) == 0
    captured = capsys.readouterr()
    assert "--preset rnd1" in captured.err
    result = json.loads(captured.out)
    assert result["nfe"] == 16


def test_max_new_tokens_sizes_the_published_decoders_block(rnd1_dir, capsys):
    """--max-new-tokens applies to the decoder the checkpoint is recognised for, not to the default it
    replaces: 10 new tokens are one block of 10, in 10 steps."""
    assert cli(["generate", "--model", str(rnd1_dir), "--max-new-tokens", "10", "--json", "Question: 2 + 2?"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["nfe"] == 10 and result["config"]["block_length"] == 10 and result["tokens"] <= 10
