"""Nemotron-Labs-Diffusion: its checkpoints as its remote code reads them, and its autoregressive and
diffusion modes token for token as that code decodes (`tests/reference/nemotron_labs_diffusion.py`
runs it: set FASTDLLM_NEMOTRON_REFERENCE to a folder holding `modeling_nemotron_labs_diffusion.py` and
`configuration_nemotron_labs_diffusion.py` as its checkpoints ship them, and FASTDLLM_NEMOTRON_PYTHON
to an interpreter with transformers >= 5.0 and torch; without them the recorded runs replay)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.models import nemotron_labs_diffusion as nld
from fastdllm.models.loading import save_pretrained
from tests.test_reference import _LIVE_RESULTS, PARTS, _reference_runs, compared, live_or_recorded, weights_digest

from .conftest import run_eagerly

NLD_CHECKOUT = os.environ.get("FASTDLLM_NEMOTRON_REFERENCE")
NLD_PYTHON = os.environ.get("FASTDLLM_NEMOTRON_PYTHON")
NLD_RUNNER = Path(__file__).parent / "reference" / "nemotron_labs_diffusion.py"
NLD_LIVE = bool(NLD_CHECKOUT and NLD_PYTHON and Path(NLD_CHECKOUT, "modeling_nemotron_labs_diffusion.py").exists())
NLD_REASON = "set FASTDLLM_NEMOTRON_REFERENCE (its remote code's folder) and FASTDLLM_NEMOTRON_PYTHON"

# YaRN with an attention factor above 1 (mscale without mscale_all_dim) and an original context of
# 16 positions, so that Llama 4's query scale is above 1 from position 16 on
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def nemotron_model(tokenizer):
    """A tiny Nemotron-Labs-Diffusion of seeded random weights (grouped-query attention, a head width
    of its own, YaRN), its head sharpened (several positions over a threshold at once) and EOS made
    likelier (answers that stop)."""
    from tests.conftest import random_model

    model = random_model(
        "nemotron_labs_diffusion", tokenizer, seed=12, n_heads=4, n_kv_heads=2, head_size=16, extra={"rope": ROPE}
    )
    with torch.no_grad():
        model.output.weight.mul_(6.0)
        model.output.weight[model.args.eos_token_id].mul_(1.5)
    return model


_DIFF = dict(mode="diffusion", gen_length=24, block_length=8, threshold=0.9, temperature=0.0, seed=0)
NLD_CONFIGS = [
    dict(mode="ar", gen_length=20, temperature=0.0, stop_at_eos=True),
    dict(mode="ar", gen_length=20, temperature=0.0, stop_at_eos=False),
    dict(mode="ar", gen_length=20, temperature=0.7, seed=4, stop_at_eos=False),
    dict(_DIFF, stop_at_eos=True),
    dict(_DIFF, stop_at_eos=False),
    dict(_DIFF, threshold=0.5, stop_at_eos=False),
    dict(_DIFF, threshold=None, block_length=4, stop_at_eos=False),
    dict(_DIFF, block_length=1, gen_length=12, stop_at_eos=True),
    dict(_DIFF, threshold=0.5, temperature=0.8, seed=5, stop_at_eos=False),
    dict(_DIFF, threshold=0.9, temperature=0.8, seed=6, stop_at_eos=True),
    dict(mode="linear_spec", gen_length=20, block_length=8, temperature=0.0, stop_at_eos=True),
    dict(mode="linear_spec", gen_length=20, block_length=4, threshold=0.5, temperature=0.0, stop_at_eos=False),
    dict(mode="linear_spec", gen_length=20, block_length=8, temperature=0.7, seed=5, stop_at_eos=False),
]
# (the sampled runs' seeds draw no [MASK]: the reference writes a drawn [MASK] back, which leaves the
# position masked, where we take the best other token: `engine.decode.strategy`)
TEXTS = ["Question: 3 + 4 = ? Answer:", "Question: what is 2 + 2?", "Tom has 5 apples and buys 3 more. He has"]


def ours_config(c: dict) -> GenerationConfig:
    """Our config for one of the reference's runs."""
    stop = c["stop_at_eos"]
    common = dict(gen_length=c["gen_length"], temperature=c["temperature"], seed=c.get("seed", 0), stop_at_eos=stop)
    common["max_thinking_tokens"] = c.get("max_thinking_tokens")
    if c["mode"] == "ar":
        return GenerationConfig.nemotron_labs_diffusion_ar(**common)
    if c["mode"] == "linear_spec":
        return GenerationConfig.nemotron_labs_diffusion_linear_spec(
            window_size=c["block_length"], threshold=c.get("threshold"), draft_adapter=c.get("draft_adapter"), **common
        )
    return GenerationConfig.nemotron_labs_diffusion(
        block_length=c["block_length"], threshold=c["threshold"], eos_early_stop=stop, **common
    )


def kept_acceptances(c: dict, ref: dict) -> list[int]:
    """The reference's acceptance lengths as we report them: each verification's accepted tokens
    that its answer keeps (the reference's `tokens` end at a stop; its last verification may
    accept drafts past the stop and past `gen_length`)."""
    out, position = [], 1  # the prompt's pass gave the first token
    for a in ref["accepts"]:
        out.append(min(a, len(ref["tokens"]) - position, c["gen_length"] - position))
        position += a
    return out


def our_nfe(c: dict, ref: dict) -> int:
    """Our forwards for a run of the reference's: the same, but where the diffusion mode's answer
    stops at a block's first token (the causal pass's): the reference still runs one bidirectional
    pass over that block before its stop rule looks; we stop at once."""
    n = len(ref["tokens"])
    first_in_block = c["mode"] == "diffusion" and n < c["gen_length"] and (n - 1) % c["block_length"] == 0
    return ref["nfe"] - (first_in_block and c["block_length"] > 1)


@pytest.fixture(scope="module")
def model(tokenizer):
    return nemotron_model(tokenizer)


@live_or_recorded(NLD_LIVE, "nemotron_labs_diffusion", reason=NLD_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_decodes_as_its_remote_code(model, tokenizer, tmp_path, part):
    """Its causal and bidirectional passes give the remote code's logits, and its autoregressive
    mode (`ar_generate`) and diffusion mode (`generate`, greedy and sampled under the same seed,
    thresholds, one position per step, blocks of one) the same tokens with the same forwards
    counted (its uncounted prefill is our first forward; its last block's closing causal pass,
    which only seeds a block that never comes, we do not run); greedy rows in a batch decode as
    alone."""
    folder = save_pretrained(model, tmp_path / "nld", tokenizer, dtype=torch.float32)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    mask = model.mask_token_id
    # a block being decoded after a prompt of which it holds the first token: past position 16
    sequences = [[p + p[:3] + [mask] * 5, len(p) + 1] for p in prompts]
    spec = {"logits": sequences, "prompts": prompts, "configs": NLD_CONFIGS}
    code = NLD_CHECKOUT if NLD_LIVE else None
    theirs = list(_reference_runs(NLD_PYTHON, NLD_RUNNER, code, folder, spec, "nemotron_labs_diffusion"))
    live = _LIVE_RESULTS.get(("nemotron_labs_diffusion", weights_digest(folder)))
    for (seq, k), logits in zip(sequences, live["logits"] if live else ()):
        x = torch.tensor([seq])
        assert torch.allclose(model(x)[0], torch.tensor(logits["causal"]), atol=1e-4, rtol=1e-4)
        from fastdllm.engine.kv.pages import PagedKVCache

        cache = PagedKVCache.for_rows(model, 1, len(seq))
        canvas = model.packed_logits(x, [(0, 0, len(seq), len(seq), k)], cache, block_size=len(seq) - k)[0]
        assert torch.allclose(canvas[1:], torch.tensor(logits["canvas"])[1:], atol=1e-4, rtol=1e-4)
    eos = model.args.eos_token_id
    stopped = parallel = sampled = 0
    for c, prompt, ref in compared(NLD_CONFIGS, prompts, iter(theirs), part):
        ours = fastdllm.generate(model, [prompt], config=ours_config(c))
        tokens = ours.sequences[0].tolist()
        ref["tokens"] = ref["tokens"][: c["gen_length"]]  # LinearSpec keeps what its last cycle accepted
        n = len(ref["tokens"])
        if c["mode"] == "linear_spec":
            assert ours.acceptances[0] == kept_acceptances(c, ref), (c, prompt)
        assert tokens[:n] == ref["tokens"], (c, prompt)
        assert tokens[n:] == [eos] * (c["gen_length"] - n)  # after a stop: EOS
        assert ours.nfe == our_nfe(c, ref), (c, ours.nfe, ref["nfe"])
        stopped += n < c["gen_length"]
        parallel += max(ours.tokens_per_step[0]) > 1
        sampled += c["temperature"] > 0
    assert sampled
    if part == "all":
        assert stopped and parallel  # answers that stopped at EOS, steps that revealed several
        for k, c in enumerate(NLD_CONFIGS):
            refs = theirs[k * len(prompts) : (k + 1) * len(prompts)]
            if c["temperature"] == 0:
                batch = fastdllm.generate(model, prompts, config=ours_config(c))
                for row, ref in zip(batch.sequences.tolist(), refs):
                    assert row[: len(ref["tokens"])] == ref["tokens"], c


# A micro twin (2 layers of 32) trained on the embedded arithmetic data with both passes' objective
# (`embedded.train.two_pass_loss`; `fastdllm train-tiny --arch nemotron_labs_diffusion --preset micro
# --steps 1500 --token-budget 4096`), so that its drafts and its causal pass agree in part.
MICRO = Path(__file__).parent / "fixtures" / "nemotron_labs_diffusion_micro"
QUESTIONS = ["What is 12 + 7?", "Tom has 5 apples and buys 3 more. How many apples does he have?"]
TRAINED_CONFIGS = [
    dict(mode="linear_spec", gen_length=32, block_length=8, temperature=0.0, stop_at_eos=True),
    dict(mode="linear_spec", gen_length=32, block_length=4, temperature=0.0, stop_at_eos=False),
    dict(mode="linear_spec", gen_length=32, block_length=16, temperature=0.0, stop_at_eos=True),
    dict(mode="linear_spec", gen_length=32, block_length=8, threshold=0.6, temperature=0.0, stop_at_eos=True),
    dict(mode="linear_spec", gen_length=32, block_length=8, temperature=0.5, seed=1, stop_at_eos=True),
    dict(mode="ar", gen_length=32, temperature=0.0, stop_at_eos=True),
    dict(_DIFF, gen_length=32, stop_at_eos=True),
    # a thinking budget (the end-of-thinking token: one the twin never writes itself); LinearSpec's
    # is `test_linear_spec_keeps_a_thinking_budget`
    dict(mode="ar", gen_length=32, temperature=0.0, stop_at_eos=True, max_thinking_tokens=5, end_think_token_id=500),
    dict(_DIFF, gen_length=32, stop_at_eos=True, max_thinking_tokens=11, end_think_token_id=500),
]


@live_or_recorded(NLD_LIVE, "nemotron_labs_diffusion_trained", reason=NLD_REASON)
@pytest.mark.parametrize("part", PARTS)
def test_a_trained_twin_speculates_as_its_remote_code(tmp_path, part):
    """On a twin whose drafts its causal pass partly accepts: LinearSpec's tokens, forwards and
    every verification's acceptance length (1 to its block) as its remote code's, at several
    block lengths, a draft threshold and sampled; and its other two modes beside it."""
    import shutil

    folder = tmp_path / "micro"
    shutil.copytree(MICRO, folder)
    model, tokenizer = fastdllm.load(folder, dtype="float32")
    model.stop_token_ids = [model.args.eos_token_id]  # the reference stops at EOS alone, not at end of turn
    model.end_think_token_id = 500  # the thinking budgets' token (its tokenizer has no </think>)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    spec = {"prompts": prompts, "configs": TRAINED_CONFIGS}
    code = NLD_CHECKOUT if NLD_LIVE else None
    theirs = _reference_runs(NLD_PYTHON, NLD_RUNNER, code, folder, spec, "nemotron_labs_diffusion_trained")
    lengths, budgets = set(), 0
    for c, prompt, ref in compared(TRAINED_CONFIGS, prompts, theirs, part):
        budgets += 500 in ref["tokens"][: c["gen_length"]] and "max_thinking_tokens" in c
        ours = fastdllm.generate(model, [prompt], config=ours_config(c))
        n = min(len(ref["tokens"]), c["gen_length"])
        assert ours.sequences[0].tolist()[:n] == ref["tokens"][:n], (c, prompt)
        assert ours.nfe == our_nfe(c, ref), (c, ours.nfe, ref["nfe"])
        if c["mode"] == "linear_spec":
            assert ours.acceptances[0] == kept_acceptances(c, ref), (c, prompt)
            lengths |= set(kept_acceptances(c, ref))
    if part == "all":
        assert len(lengths) > 4 and max(lengths) > 4  # acceptances of many lengths, long ones among them
        assert budgets == 4  # every thinking budget placed its token


LORA_CONFIGS = [
    dict(mode="linear_spec", gen_length=32, block_length=8, temperature=0.0, stop_at_eos=True),
    dict(mode="linear_spec", gen_length=32, block_length=4, temperature=0.0, stop_at_eos=False),
    dict(mode="linear_spec", gen_length=32, block_length=8, temperature=0.5, seed=1, stop_at_eos=True),
]


@live_or_recorded(NLD_LIVE, "nemotron_labs_diffusion_lora", reason=NLD_REASON + " with peft installed")
@pytest.mark.parametrize("part", PARTS)
def test_its_linear_spec_lora_drafts_and_never_verifies(tmp_path, part):
    """A checkpoint's `linear_spec_lora/` (a PEFT adapter on o_proj, made by PEFT over its remote
    code) loads by that name and, as `draft_adapter`, decodes LinearSpec's drafts only, as its
    remote code turns it on and off: the same tokens, forwards and acceptances. Greedy, the answer
    is the one without the adapter (verification decides it), reached with other acceptances."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "micro"
    shutil.copytree(MICRO, folder)
    model, tokenizer = fastdllm.load(folder, dtype="float32")
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    adapter = {"seed": 2, "r": 4, "alpha": 16, "targets": ["o_proj"]}
    spec = {"prompts": prompts, "configs": LORA_CONFIGS, "adapter": adapter}
    code = NLD_CHECKOUT if NLD_LIVE else None
    theirs = _reference_runs(NLD_PYTHON, NLD_RUNNER, code, folder, spec, "nemotron_labs_diffusion_lora")
    made = next(theirs)["adapter"]
    (folder / "linear_spec_lora").mkdir()
    save_file(
        {k: torch.tensor(v) for k, v in made["tensors"].items()},
        folder / "linear_spec_lora" / "adapter_model.safetensors",
    )
    (folder / "linear_spec_lora" / "adapter_config.json").write_text(json.dumps(made["config"]))
    drafted, _ = fastdllm.load(folder, dtype="float32")
    assert drafted.lora.names == ["linear_spec_lora"]
    for m in (model, drafted):
        m.stop_token_ids = [m.args.eos_token_id]  # the reference stops at EOS alone
    changed = 0
    for c, prompt, ref in compared(LORA_CONFIGS, prompts, theirs, part):
        ours = fastdllm.generate(drafted, [prompt], config=ours_config(dict(c, draft_adapter="linear_spec_lora")))
        n = min(len(ref["tokens"]), c["gen_length"])
        assert ours.sequences[0].tolist()[:n] == ref["tokens"][:n], (c, prompt)
        assert ours.nfe == ref["nfe"] and ours.acceptances[0] == kept_acceptances(c, ref), (c, prompt)
        if c["temperature"] == 0:
            plain = fastdllm.generate(model, [prompt], config=ours_config(c))
            assert plain.sequences.tolist() == ours.sequences.tolist()
            changed += plain.acceptances != ours.acceptances
    assert changed  # the adapter drafts differently
    with pytest.raises(ValueError, match="^draft_adapter: needs a cache"):  # it would recompute with the adapter
        config = ours_config(dict(LORA_CONFIGS[0], draft_adapter="linear_spec_lora"))
        fastdllm.generate(drafted, prompts[:1], config=config.replace(refresh="full"))


def test_its_published_config_reads_and_writes_as_its_config_class(tmp_path, tokenizer):
    """The 3B's config.json: its Ministral 3 sizes, mask id 100, YaRN, Llama 4's query scale; a
    saved checkpoint keeps its RoPE parameters; what it cannot run is refused, naming the field."""
    args = nld.FAMILY.args_from_config(nld.REFERENCE_CONFIG)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (3072, 26, 32, 8, 128)
    assert (args.mask_token_id, args.eos_token_id, args.shifted_logits, args.tie_embeddings) == (100, 2, True, False)
    assert args.extra["rope"]["rope_type"] == "yarn" and args.rope_theta == 1e6
    saved = nld.FAMILY.config_from_args(args)
    assert saved["rope_parameters"] == nld.REFERENCE_CONFIG["rope_parameters"]
    for field, value in (
        ("dlm_paradigm", "block_diff"),
        ("tie_word_embeddings", True),
        ("attention_bias", True),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e6}),
    ):
        with pytest.raises(ValueError, match=field):
            nld.FAMILY.args_from_config({**nld.REFERENCE_CONFIG, field: value})


def test_yarn_matches_transformers(model):
    """YaRN's frequencies and attention factor, and Llama 4's query scale, as transformers computes
    them (where it is installed)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.PretrainedConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=2048, rope_parameters=dict(ROPE)
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours, our_factor = nld.yarn_inv_freq(ROPE, 16, 2048)
    assert torch.equal(ours, inv_freq) and our_factor == factor > 1
    scale = model.query_scale(torch.tensor([[0, 15, 16, 40]]))[0, 0, :, 0]
    assert scale[:2].tolist() == [1.0, 1.0] and scale[2] > 1 and scale[3] > scale[2]


def test_modes_from_the_command_line_and_the_server_names(model, tokenizer, tmp_path, capsys):
    """A saved checkpoint decodes in its diffusion mode unless told otherwise; `--preset` picks the
    autoregressive mode; both answer the same greedy tokens for a prompt whose answer the causal
    pass alone decides (blocks of one position reveal as the autoregressive mode does)."""
    from fastdllm.cli.main import main

    folder = save_pretrained(model, tmp_path / "nld", tokenizer, dtype=torch.float32)
    loaded, _ = fastdllm.load(folder)
    assert loaded.decoding == "nemotron_labs_diffusion"
    config = GenerationConfig.for_model(loaded)
    assert (config.block_length, config.threshold, config.cache, config.eos_early_stop) == (32, 0.9, "dual", True)
    prompt = tokenizer.encode(TEXTS[0])
    ar = fastdllm.generate(loaded, [prompt], config=GenerationConfig.nemotron_labs_diffusion_ar(gen_length=8))
    blocks_of_one = GenerationConfig.nemotron_labs_diffusion(gen_length=8, block_length=1)
    assert fastdllm.generate(loaded, [prompt], config=blocks_of_one).sequences.tolist() == ar.sequences.tolist()
    assert ar.nfe == 8 or ar.sequences[0].tolist().count(model.args.eos_token_id)
    args = ["generate", "--model", str(folder), "--preset", "nemotron_labs_diffusion_ar", "--max-new-tokens", "8"]
    assert main([*args, "--raw", "--json", TEXTS[0]]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["block_length"] == 1 and result["config"]["gen_length"] == 8
    assert result["text"] == tokenizer.decode(ar.sequences[0].tolist(), skip_special_tokens=True)


def test_bad_input_is_refused_by_name(model):
    with pytest.raises(ValueError, match="preset"):
        GenerationConfig.preset("nemotron_labs_difusion")
    with pytest.raises(ValueError, match="logits for"):
        model.logits_for(torch.tensor([[1, 2, 3]]), 0, 2)


def arrive_together(srv, call, n: int) -> None:
    """`call(i)` for i < n from n threads, all queued before the server decodes any (one batch)."""
    import threading

    from tests.test_server import wait_for

    srv.scheduler.pause()
    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_for(lambda: srv.health()["queued"] == n)
    finally:
        srv.scheduler.resume()
    for t in threads:
        t.join(120)


@pytest.mark.slow
def test_served_in_both_modes_each_request_as_alone(model, tokenizer):
    """The server decodes it in its diffusion mode by default and in blocks of one position (its
    autoregressive mode's tokens) on request; requests that arrive together answer as alone."""
    from tests.test_server import LiveServer

    srv = LiveServer(model, tokenizer, defaults=GenerationConfig.for_model(model).replace(gen_length=32))
    try:
        jobs = [
            dict(prompt=TEXTS[i % 3], max_tokens=16, seed=i, temperature=0.0 if i % 2 else 0.7, extra_body=extra)
            for i, extra in enumerate([{}, {}, {}, {"block_length": 1}, {"block_length": 1}, {"threshold": 0.5}])
        ]
        results: list = [None] * len(jobs)

        def call(i):
            results[i] = srv.client.completions.create(model="llada-arith", **jobs[i])  # LiveServer's served name

        arrive_together(srv, call, len(jobs))
        for i, kw in enumerate(jobs):
            single = srv.client.completions.create(model="llada-arith", **kw)
            assert results[i].choices[0].text == single.choices[0].text, i
        ar = fastdllm.generate(
            model, [tokenizer.encode(TEXTS[0])], config=GenerationConfig.nemotron_labs_diffusion_ar(gen_length=16)
        )
        assert results[3].usage.completion_tokens <= 16
        assert results[3].choices[0].text == tokenizer.decode(
            [t for t in ar.sequences[0].tolist() if t != model.args.eos_token_id], skip_special_tokens=True
        )
    finally:
        srv.stop()


def test_linear_spec_served_with_its_acceptance_reported(model, tokenizer):
    """LinearSpec rows batched on their own clocks answer as alone; each response's usage reports
    its verifications and their mean acceptance length, and /metrics counts them as vLLM does."""
    import httpx

    from tests.test_server import LiveServer

    config = GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=16, window_size=4)
    srv = LiveServer(model, tokenizer, defaults=config)
    try:
        jobs = [dict(prompt=t, max_tokens=16, temperature=0.0) for t in TEXTS]
        results: list = [None] * len(jobs)

        def call(i):
            results[i] = srv.post("/v1/completions", {"model": "llada-arith", **jobs[i]}).json()

        arrive_together(srv, call, len(jobs))
        verified = 0
        for text, body in zip(TEXTS, results):
            alone = fastdllm.generate(model, [tokenizer.encode(text)], config=config)
            speculation = body["usage"]["speculation"]
            assert speculation["verifications"] == len(alone.acceptances[0]) > 0
            assert speculation["accepted_tokens"] == sum(alone.acceptances[0])
            assert speculation["mean_acceptance_length"] >= 1
            verified += speculation["verifications"]
        for job, body in zip(jobs, results):
            single = srv.post("/v1/completions", {"model": "llada-arith", **job}).json()
            assert body["choices"][0]["text"] == single["choices"][0]["text"]
            verified += single["usage"]["speculation"]["verifications"]
        metrics = httpx.get(srv.url + "/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) == verified
    finally:
        srv.stop()


def micro_twin(tmp_path):
    """The trained twin (its drafts partly accepted), stopping at EOS as its remote code does."""
    import shutil

    folder = tmp_path / "micro"
    shutil.copytree(MICRO, folder)
    model, tokenizer = fastdllm.load(folder, dtype="float32")
    model.stop_token_ids = [model.args.eos_token_id]
    questions = [*QUESTIONS, "What is 9 - 4?", "Sam had 8 pens and gave away 2. How many are left?"]
    chats = [[{"role": "user", "content": q}] for q in questions]
    return model, tokenizer, [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]


def test_its_three_modes_decode_in_one_batch_each_as_alone(tmp_path):
    """Rows in its diffusion mode (blocks of 8), autoregressive mode and LinearSpec (drafts of 8,
    and of 4 sampled) share every forward of one batch, each row on its own block length and
    clock, and decode as alone: the same tokens, forwards and acceptances."""
    from fastdllm.engine.decoder import BlockDecoder

    model, _, prompts = micro_twin(tmp_path)
    configs = [
        GenerationConfig.nemotron_labs_diffusion(gen_length=32, block_length=8),
        GenerationConfig.nemotron_labs_diffusion_ar(gen_length=24),
        GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=32, window_size=8),
        GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=32, window_size=4, temperature=0.7, seed=3),
    ]
    decoder = BlockDecoder(model, configs[1])
    rows = [decoder.add([p], config=c)[0] for p, c in zip(prompts, configs)]
    while decoder.active:
        decoder.step()
    for r, p, c in zip(rows, prompts, configs):
        alone = fastdllm.generate(model, [p], config=c)
        assert torch.equal(r.answer, alone.sequences[0]), c
        assert r.nfe == alone.nfe_per_row[0] and r.acceptances == alone.acceptances[0], c
    assert all(rows[k].acceptances for k in (2, 3)) and max(rows[2].acceptances) > 1
    # the forwards were shared (rows whose chat prompts share a prefix join a step after the first)
    assert decoder.nfe <= max(r.nfe for r in rows) + 1 and decoder.row_forwards == sum(r.nfe for r in rows)


def test_its_three_modes_served_in_one_batch(tmp_path):
    """Requests naming its three modes' presets, queued together, decode in one batch and answer
    as each does alone; LinearSpec's reports its verifications."""
    from tests.test_server import LiveServer

    model, tokenizer, prompts = micro_twin(tmp_path)
    srv = LiveServer(model, tokenizer, defaults=GenerationConfig.nemotron_labs_diffusion(gen_length=32))
    presets = ["nemotron_labs_diffusion", "nemotron_labs_diffusion_ar", "nemotron_labs_diffusion_linear_spec"]
    try:
        jobs = [dict(prompt=prompts[i], max_tokens=24, temperature=0.0, preset=p) for i, p in enumerate(presets)]
        results: list = [None] * len(jobs)

        def call(i):
            results[i] = srv.post("/v1/completions", {"model": "llada-arith", **jobs[i]}).json()

        arrive_together(srv, call, len(jobs))
        stats = srv.scheduler.stats
        assert stats["batches"] == 1 and stats["max_batch_requests"] == 3
        for job, body in zip(jobs, results):
            single = srv.post("/v1/completions", {"model": "llada-arith", **job}).json()
            assert body["choices"][0]["text"] == single["choices"][0]["text"], job["preset"]
            assert body["usage"]["completion_tokens"] == single["usage"]["completion_tokens"]
        assert results[2]["usage"]["speculation"]["verifications"] > 0
        assert "speculation" not in results[0]["usage"] and "speculation" not in results[1]["usage"]
    finally:
        srv.stop()


def test_likelihood_is_its_causal_passes_exact_sum(model, tokenizer):
    """lm-eval's log-likelihood of a model that also runs causally is the exact sum of its causal
    log-probabilities (no Monte-Carlo masking), and its greedy continuation is the one the
    autoregressive mode decodes."""
    from fastdllm.engine.likelihood import is_greedy, loglikelihood

    prefix = tokenizer.encode(TEXTS[0])
    ar = fastdllm.generate(model, [prefix], config=GenerationConfig.nemotron_labs_diffusion_ar(gen_length=6))
    target = ar.sequences[0].tolist()
    logprobs = model(torch.tensor([prefix + target]))[0].log_softmax(-1)
    exact = sum(float(logprobs[len(prefix) - 1 + j, t]) for j, t in enumerate(target))
    assert loglikelihood(model, prefix, target) == pytest.approx(exact, abs=1e-4)
    assert is_greedy(model, prefix, target)
    other = [(t + 1) % model.args.vocab_size for t in target]
    assert not is_greedy(model, prefix, other) and loglikelihood(model, prefix, other) < exact


def test_linear_spec_keeps_a_thinking_budget(tmp_path):
    """LinearSpec's thinking budget: the first cycle that ends at or past the budget with no
    end-of-thinking token makes its next token one, which the answer holds (its remote code gives
    the next draft the token but keeps the causal pass's in the answer, and so forces it again at
    every later cycle: not reproduced); the answer before it is the unbudgeted one."""
    model, tokenizer = fastdllm.load(MICRO, dtype="float32")
    model.end_think_token_id = 500
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True)
    config = GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=32, window_size=8)
    free = fastdllm.generate(model, [prompt["input_ids"]], config=config).sequences[0].tolist()
    kept = fastdllm.generate(model, [prompt["input_ids"]], config=config.replace(max_thinking_tokens=7))
    tokens = kept.sequences[0].tolist()
    assert tokens.count(500) == 1 and tokens.index(500) >= 7
    assert tokens[: tokens.index(500)] == free[: tokens.index(500)]
    model.end_think_token_id = None
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        fastdllm.generate(model, [prompt["input_ids"]], config=config.replace(max_thinking_tokens=7))


@pytest.mark.parametrize(
    "preset", [pytest.param("nemotron_labs_diffusion", marks=pytest.mark.slow), "nemotron_labs_diffusion_linear_spec"]
)
def test_its_causal_prompts_are_shared_and_prefilled_in_chunks_exactly(preset):
    """Its prompt is its causal pass's, so a prefix's K/V depend on nothing after it: 4-shot prompts
    share their exemplars' K/V exactly (on by default) and long prompts are computed in chunks,
    each decoding the tokens it decodes without either, with fewer positions computed."""
    from fastdllm.engine.kv import runner_for
    from fastdllm.evaluation.tasks import arith

    model, tok = fastdllm.load(MICRO, dtype="float32")
    runner_for(model).reset_prefix_cache()
    pool = arith.fewshot_pool()[:4]
    ids = [arith.prompt_ids(tok, p.question, pool) for p in arith.test_split()[:4]]
    config = GenerationConfig.preset(preset, gen_length=32)
    assert config.prefix_cache == "exact"
    off = fastdllm.generate(model, ids, config=config.replace(prefix_cache="off"))
    on = fastdllm.generate(model, ids, config=config)
    chunked = fastdllm.generate(model, ids, config=config.replace(prefix_cache="off", prefill_chunk=64))
    assert torch.equal(off.sequences, on.sequences) and torch.equal(off.sequences, chunked.sequences)
    assert sum(on.forward_positions) < sum(off.forward_positions)


def test_its_modes_decode_the_same_with_the_fixed_shape_step(model, tokenizer, monkeypatch):
    """`cuda_graphs`: its modes' steps run as the fixed-shape step (eagerly here: on a GPU, a
    captured graph), the block seeing what its window sees and nothing after it, LinearSpec's
    drafts their span both ways and its verifications causally; the same tokens as without."""
    calls = run_eagerly(monkeypatch)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    configs = [
        GenerationConfig.nemotron_labs_diffusion(gen_length=24, block_length=8, threshold=0.5),
        GenerationConfig.nemotron_labs_diffusion(gen_length=24, block_length=8, threshold=0.5, suffix_window=None),
        GenerationConfig.nemotron_labs_diffusion_ar(gen_length=8),
        GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=16, window_size=4),
        GenerationConfig.nemotron_labs_diffusion_linear_spec(gen_length=16, window_size=8, temperature=0.8, seed=3),
    ]
    for config in configs:
        eager_out = fastdllm.generate(model, prompts, config=config)
        before = len(calls)
        graphed = fastdllm.generate(model, prompts, config=config.replace(cuda_graphs=True))
        assert torch.equal(graphed.sequences, eager_out.sequences), config
        assert graphed.nfe_per_row == eager_out.nfe_per_row, config
        assert graphed.acceptances == eager_out.acceptances, config
        assert len(calls) > before, config  # each mode's steps went through it
    assert len({args[2][0, 0].item() for args in calls}) > 1  # steps at several blocks
