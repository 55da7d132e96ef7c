"""`GenerationConfig` is the one declaration of every decoding option: the CLI flags, the
server's request fields and the lm-eval parsing come from it, and errors name the field."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from fastdllm import GenerationConfig
from fastdllm.cli.args import UserError, add_generation_args, config_from_args, with_model_defaults
from fastdllm.config import ConfigError

BAD = {
    "gen_length": 0,
    "block_length": 7,
    "steps": 1000,
    "temperature": -1,
    "remasking": "x",
    "threshold": 1.5,
    "factor": 0,
    "cache": "x",
    "unmasking": "x",
    "alg": "x",
    "alg_temp": -1,
    "eps": 1,
    "top_p": 0,
    "top_k": 0,
    "stop_at_eos": "yes",
    "eos_early_stop": "yes",
    "seed": 1.5,
    "logprobs": 21,
    "suffix_window": -1,
    "sub_block_length": 5,
    "editing_threshold": 1.5,
    "max_post_steps": -1,
    "refresh": "sometimes",
    "prefix_cache": "always",
    "refresh_every": 0,
    "refresh_tol": -1,
    "cache_delay": -1,
    "refresh_interval": 0,
    "prefill_chunk": 8,
    "compile": 1,
    "deterministic": "yes",
    "cuda_graphs": "yes",
    "confidence_temperature": 0,
    "parallel_blocks": 0,
    "block_add_threshold": 2,
    "decoded_token_threshold": -0.5,
    "lookahead_threshold": 1.01,
    "fixed": {300: "x"},
    "stop_confidence": 0.9,
    "soft_embeddings": True,
    "suffix": "",
    "max_denoising_steps": 0,
    "entropy_bound": 0,
    "t_min": -0.1,
    "t_max": 0.2,
    "stability_threshold": -1,
    "window_size": 0,
    "adapter": "",
    "draft_adapter": "",
    "max_thinking_tokens": -1,
    "logprobs_mode": "logits",
    "pos_penalty_factor": -0.1,
    "confidence_threshold": 0,
}


def test_every_field_has_a_bad_value_here():
    assert set(BAD) == set(GenerationConfig.field_names())


@pytest.mark.parametrize("name", sorted(BAD))
def test_invalid_value_is_a_config_error_naming_the_field(name):
    with pytest.raises(ConfigError) as info:
        GenerationConfig(**{name: BAD[name]})
    assert isinstance(info.value, ValueError) and info.value.param == name
    assert str(info.value).startswith(f"{name}: ")


def test_the_defaults_and_the_presets(tiny_llada, tokenizer):
    d = GenerationConfig()
    assert (d.cache, d.threshold, d.suffix_window, d.refresh) == ("dual", 0.9, 32, "vicinity")
    f = GenerationConfig.fast_dllm()
    assert (f.cache, f.threshold, f.suffix_window, f.refresh, f.gen_length, f.block_length) == (
        "dual",
        0.9,
        None,
        "full",
        256,
        32,
    )
    b = GenerationConfig.baseline()
    assert (b.cache, b.threshold, b.suffix_window, b.refresh) == ("none", None, None, "full")
    # Without a cache every forward is full: the default refresh is accepted and changes nothing.
    no_cache = GenerationConfig(cache="none", threshold=None, gen_length=16, block_length=8, stop_at_eos=False)
    assert no_cache.refresh == "vicinity"
    from fastdllm import generate

    ids = [tokenizer.encode("Tom has 5 apples.")]
    assert torch.equal(
        generate(tiny_llada, ids, no_cache).sequences,
        generate(tiny_llada, ids, no_cache.replace(refresh="full")).sequences,
    )


def test_config_is_immutable_and_replace_validates():
    cfg = GenerationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_length = 7
    with pytest.raises(ConfigError):
        cfg.replace(block_length=7)
    assert cfg.replace(threshold=None).threshold is None and cfg.threshold == 0.9


def test_cli_flags_are_generated_from_the_fields():
    p = argparse.ArgumentParser()
    add_generation_args(p)
    flags = {a.dest: a.option_strings for a in p._actions if a.dest not in ("help", "preset")}
    assert set(flags) == set(GenerationConfig.field_names())
    for name, strings in flags.items():
        assert "--" + name.replace("_", "-") in strings
    args = p.parse_args(["--threshold", "none", "--no-stop-at-eos", "--top-k", "5", "--cache", "prefix"])
    cfg = config_from_args(args)
    assert (cfg.threshold, cfg.stop_at_eos, cfg.top_k, cfg.cache) == (None, False, 5, "prefix")
    with pytest.raises(UserError, match="^--block-length: must divide"):
        config_from_args(p.parse_args(["--block-length", "7"]))


def test_parse_reads_text_by_the_fields_kind():
    assert GenerationConfig.parse("threshold", "off") is None
    assert GenerationConfig.parse("steps", "64") == 64
    assert GenerationConfig.parse("stop_at_eos", "false") is False
    assert GenerationConfig.parse("alg", "null") is None
    assert GenerationConfig.parse("threshold", 0.5) == 0.5  # values pass through
    with pytest.raises(ConfigError) as info:
        GenerationConfig.parse("gen_length", "many")
    assert info.value.param == "gen_length"
    with pytest.raises(ConfigError):
        GenerationConfig.parse("temperature", "none")  # not optional


def test_server_request_fields_are_the_declared_options():
    from fastdllm.server import DLLM_FIELDS, ChatCompletionRequest, CompletionRequest

    declared = {o["name"] for o in GenerationConfig.options() if o["server"]}
    assert set(DLLM_FIELDS) == declared
    for model in (ChatCompletionRequest, CompletionRequest):
        assert declared <= set(model.model_fields)
    # the OpenAI names take the fields that are not server options
    assert {"gen_length", "seed"}.isdisjoint(declared)


def test_presets_and_the_preset_flag():
    assert GenerationConfig.fast_dllm() == GenerationConfig(
        cache="dual", threshold=0.9, suffix_window=None, refresh="full", gen_length=256, block_length=32
    )
    assert GenerationConfig.preset("baseline") == GenerationConfig.baseline()
    with pytest.raises(ConfigError) as info:
        GenerationConfig.preset("warp")
    assert info.value.param == "preset"
    p = argparse.ArgumentParser()
    add_generation_args(p)
    cfg = config_from_args(p.parse_args(["--preset", "fast-dllm", "--gen-length", "64"]))
    assert cfg == GenerationConfig.fast_dllm(gen_length=64)
    cfg = config_from_args(p.parse_args(["--preset", "baseline", "--no-stop-at-eos"]))
    assert cfg == GenerationConfig.baseline(stop_at_eos=False)


def test_the_config_and_the_sandbox_import_without_torch():
    """Declarations depend on nothing, and judged programs' sandbox needs only the standard
    library: both import (and work) with torch and numpy hidden."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\nclass Hide:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'numpy'):\n            raise ImportError('hidden: ' + name)\n"
        "sys.meta_path.insert(0, Hide())\nimport fastdllm.config, fastdllm.sandbox\n"
        "cfg = fastdllm.config.GenerationConfig(threshold=0.8, cache='prefix')\n"
        "r = fastdllm.sandbox.run_program('print(6 * 7)')\n"
        "print(cfg.threshold, r.verdict, r.stdout.strip(), 'torch' in sys.modules)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo)
    assert out.stdout.split() == ["0.8", "passed", "42", "False"], out.stderr[-2000:]


def test_dream_coders_are_recognised_and_decode_as_their_cards():
    """DiffuCoder and Dream-Coder load as Dream; a checkpoint named for one decodes as its card's
    example does: the answer one block, a step per token, entropy order, top-p 0.95."""
    from fastdllm.models.loading import recognized_decoding

    assert recognized_decoding("apple/DiffuCoder-7B-Instruct", {}) == "diffucoder"
    assert recognized_decoding("/models/x", {"_name_or_path": "Dream-org/Dream-Coder-v0-Instruct-7B"}) == "dream-coder"
    assert recognized_decoding("Dream-org/Dream-v0-Instruct-7B", {}) is None
    for name, temperature, gen in (("diffucoder", 0.3, 256), ("dream-coder", 0.1, 768)):
        config = GenerationConfig.preset(name)
        assert (config.alg, config.temperature, config.top_p, config.cache) == ("entropy", temperature, 0.95, "none")
        assert config.gen_length == config.block_length == gen and config.total_steps == gen
        short = config.with_max_new_tokens(100)
        assert short.gen_length == short.block_length == 100 and short.total_steps == 100


def test_a_checkpoints_own_block_length_is_its_default_but_not_a_presets(tiny_llada_dir, tmp_path):
    """A LLaDA checkpoint whose generation_config.json names `block_length` decodes in those blocks
    by default (Python, CLI), where the answer holds whole blocks of it; a named preset keeps its
    own (Fast-dLLM's 32), a given flag wins, and saving the checkpoint keeps the file."""
    import json
    import shutil

    import fastdllm
    from fastdllm.models.loading import save_pretrained

    folder = tmp_path / "own-block"
    shutil.copytree(tiny_llada_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"block_length": 64}))
    model, tok = fastdllm.load(str(folder), dtype="float32")
    assert GenerationConfig.for_model(model).block_length == 64
    assert GenerationConfig.for_model(model, checkpoint_defaults=False).block_length == 64
    assert GenerationConfig.for_model(model, gen_length=96).block_length == GenerationConfig().block_length
    assert GenerationConfig.for_model(model, block_length=16).block_length == 16

    def cli(*flags):
        p = argparse.ArgumentParser()
        add_generation_args(p)
        args = p.parse_args(list(flags))
        return with_model_defaults(args, config_from_args(args), model)

    assert cli().block_length == 64 and cli("--block-length", "32").block_length == 32
    assert cli("--preset", "fast-dllm").block_length == GenerationConfig.fast_dllm().block_length == 32
    assert cli("--preset", "default").block_length == 64  # our default decoding takes the model's own
    from fastdllm.demo.frames import pane_config

    assert pane_config(model, "default").block_length == 64 and pane_config(model, "fast-dllm").block_length == 32
    saved = save_pretrained(model, tmp_path / "saved", tok)
    assert json.loads((saved / "generation_config.json").read_text())["block_length"] == 64
