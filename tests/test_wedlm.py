"""WeDLM as a user meets it: a checkpoint in its layout loads, is recognised, and decodes with its
engine's sliding window by default (`GenerationConfig.wedlm`) from Python, the CLI, the server and
lm-eval, its prefix cache exact. Token parity with its engine's own decoder is
`tests/test_reference.py::test_wedlm_decodes_as_its_engines_decoder`."""

from __future__ import annotations

import json

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.cli.main import main as cli
from fastdllm.models.loading import save_pretrained
from tests.test_reference import wedlm_model

PROMPTS = ["Question: 3 + 4 = ? Answer:", "Question: what is 2 + 2?", "Tom has 5 apples and buys 3 more. He has"]


@pytest.fixture(scope="module")
def model(tokenizer):
    return wedlm_model(tokenizer, "qwen2.5")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model, tokenizer):
    return save_pretrained(model, tmp_path_factory.mktemp("wedlm"), tokenizer, dtype=torch.float32)


def test_a_checkpoint_loads_and_decodes_with_its_engines_settings(folder, model):
    loaded, tok = fastdllm.load(str(folder), dtype="float32")
    assert loaded.family.name == "WeDLM" and loaded.decoding == "wedlm"
    assert (loaded.args.block_size, loaded.args.masks_last, loaded.args.qkv_bias) == (1, True, True)
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name
    config = GenerationConfig.for_model(loaded, gen_length=24)
    assert (config.unmasking, config.block_length, config.window_size, config.threshold) == ("wedlm", 1, 16, 0.4)
    assert (config.cache, config.temperature, config.pos_penalty_factor) == ("prefix", 0.0, 0.02)
    out = fastdllm.generate(loaded, [tok.encode(PROMPTS[0])], config=config)
    assert out.sequences.shape == (1, 24)


def test_the_prefix_cache_is_exact_and_computes_only_the_window(model, tokenizer):
    """No cache and the prefix cache (either refresh) give the same tokens in the same steps; a
    cached step computes the window (16) and the positions that became final since the step before
    (each once), not the whole row."""
    prompt = tokenizer.encode(PROMPTS[0])
    runs = {}
    for cache, refresh in (("none", "full"), ("prefix", "vicinity"), ("prefix", "full"), ("dual", "vicinity")):
        config = GenerationConfig.wedlm(gen_length=24, cache=cache, refresh=refresh, stop_at_eos=False)
        runs[cache, refresh] = fastdllm.generate(model, [prompt], config=config)
    base = runs["none", "full"]
    for out in runs.values():
        assert out.sequences.tolist() == base.sequences.tolist() and out.nfe == base.nfe
    cached = runs["prefix", "vicinity"]
    assert base.nfe > 3 and base.forward_positions[0] >= base.nfe * len(prompt)
    assert cached.forward_positions[0] <= len(prompt) + cached.nfe * 16 + 24


def test_rows_of_a_batch_decode_as_alone_greedy_and_sampled(model, tokenizer):
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    greedy = GenerationConfig.wedlm(gen_length=20, threshold=1.0)
    batch = fastdllm.generate(model, prompts, config=greedy)
    for i, p in enumerate(prompts):
        assert batch.sequences[i].tolist() == fastdllm.generate(model, [p], config=greedy).sequences[0].tolist()
    sampled = greedy.replace(temperature=0.8, stop_at_eos=False)
    batch = fastdllm.generate(model, prompts, config=sampled, row_seeds=[4, 9, 2])
    for i, seed in enumerate((4, 9, 2)):
        alone = fastdllm.generate(model, [prompts[i]], config=sampled.replace(seed=seed))
        assert batch.sequences[i].tolist() == alone.sequences[0].tolist()


def test_masks_come_last_in_its_causal_attention(model, tokenizer):
    """Its full forward is causal; over a partly masked sequence it equals a causal forward over the
    sequence reordered with its tokens first (each at its own RoPE position), as WeDLM reorders."""
    ids = tokenizer.encode(PROMPTS[2])
    logits = model(torch.tensor([ids]))[0]
    assert torch.allclose(logits[:6], model(torch.tensor([ids[:6]]))[0], atol=1e-5)  # later tokens unseen
    mask = model.mask_token_id
    masked = list(ids)
    for k in (4, 5, 9):
        masked[k] = mask
    order = [k for k, t in enumerate(masked) if t != mask] + [k for k, t in enumerate(masked) if t == mask]
    tokens, positions = torch.tensor([[masked[k] for k in order]]), torch.tensor([order])
    causal = torch.ones(len(order), len(order), dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        reordered = model.head(model.hidden(tokens, positions, causal))[0]
        ours = model(torch.tensor([masked]))[0]
    assert torch.allclose(ours[order], reordered, atol=1e-5)
    assert not torch.allclose(ours[4], model(torch.tensor([masked[:5]]))[0][4], atol=1e-3)  # a mask sees later tokens


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(block_length=2, gen_length=24), "block_length"),
        (dict(parallel_blocks=2), "parallel_blocks"),
        (dict(window_size=0), "window_size"),
        (dict(pos_penalty_factor=-1.0), "pos_penalty_factor"),
        (dict(threshold=-0.5), "threshold"),
    ],
)
def test_bad_settings_are_refused_by_name(change, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        GenerationConfig.wedlm(**change)


def test_a_suffix_is_refused_by_name(model, tokenizer):
    config = GenerationConfig.wedlm(gen_length=8, suffix=(5, 6))
    with pytest.raises(ValueError, match="^suffix:"):
        fastdllm.generate(model, [tokenizer.encode("hi")], config=config)


def test_the_cli_decodes_it_with_its_own_preset(folder, capsys):
    assert cli(["generate", "--model", str(folder), "--max-new-tokens", "10", "--json", "Question: 2 + 2?"]) == 0
    captured = capsys.readouterr()
    assert "--preset wedlm" in captured.err
    result = json.loads(captured.out)
    assert result["config"]["unmasking"] == "wedlm" and result["config"]["gen_length"] == 10
    # a step reveals at least one position of the window, which runs 15 past the answer
    assert 1 <= result["nfe"] <= 10 + 15 and result["tokens"] <= 10


def test_the_server_streams_it_and_refuses_what_it_cannot_do(model, tokenizer):
    """Its decoding by default; a block length other than 1 is a 400 naming the field, and the
    next request (with log-probabilities) is served; a streamed answer arrives in pieces."""
    from tests.test_server import MODEL, LiveServer

    config = GenerationConfig.for_model(model, gen_length=12)
    server = LiveServer(model, tokenizer, defaults=config)
    try:
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "Q", "max_tokens": 4, "block_length": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "block_length", r.text
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "Q", "max_tokens": 4, "logprobs": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) <= 4
        chat = [{"role": "user", "content": "2 + 2?"}]
        r = server.post("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 6})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    finally:
        server.stop()


def test_lm_eval_decodes_it_with_its_engines_settings(folder):
    from fastdllm import lm_eval_plugin
    from tests.test_eval import _FakeLM, _Req

    cls = lm_eval_plugin.make_model_class(_FakeLM, lambda name: lambda c: c)
    lm = cls(pretrained=str(folder), dtype="float32", window_size=8)
    config = lm.base_config
    assert (config.unmasking, config.block_length, config.window_size) == ("wedlm", 1, 8)
    out = lm.generate_until([_Req("Question: 2 + 2?\nAnswer:", {"until": ["Question:"], "max_gen_toks": 6})])
    assert len(out) == 1 and isinstance(out[0], str)


def test_a_grammar_decodes_its_window_left_to_right(model, tokenizer):
    """Under a JSON schema the window's first mask takes the grammar's token and a run after it the
    grammar accepts: the answer parses and follows the schema, in fewer steps than its tokens."""
    from fastdllm.engine.constraints import response_format_constraint

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    constraint = response_format_constraint(fmt, tokenizer, model.stop_token_ids, budget=24)
    config = GenerationConfig.wedlm(gen_length=24, threshold=3.0)
    out = fastdllm.generate(model, [tokenizer.encode(PROMPTS[0])], config=config, constraints=[constraint])
    text = tokenizer.decode(out.sequences[0][: out.num_tokens[0]])
    assert isinstance(json.loads(text)["n"], int), text
    assert out.nfe < out.num_tokens[0]


@pytest.mark.parametrize("command", [["bench", "--quick"], ["tune", "--task", "arith", "--out", "x.json"]])
def test_bench_and_tune_say_why_they_do_not_apply(folder, capsys, command):
    assert cli([command[0], "--model", str(folder), *command[1:]]) == 2
    assert "sliding window" in capsys.readouterr().err
