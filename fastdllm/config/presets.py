"""The presets: the configs of the published decoders (each function builds one for the config class
it is given; `GenerationConfig.fast_dllm()` and its siblings call them), the names `--preset`
takes, and preset files (`fastdllm tune --out`).

They live here, beside the fields, rather than in their decoders' files (`engine/decode/`): a config,
its presets and its rules are read and checked without torch, so that the command line refuses a
mistyped flag before it imports torch, and the sandbox reads configs with no torch at all. Where each
is implemented (`engine/decode/`): baseline `llada.py`; fast_dllm `fast_dllm.py`; dparallel and d3llm
`dparallel.py` (d3llm's lookahead and early stop too); dmax `dmax.py` and `llada2.py` (its editing);
rnd1 `rnd1.py`; wedlm `wedlm.py`; the coders `dream.py`; diffusion_gemma `renoising.py`;
nemotron_labs_diffusion and its autoregressive mode `nemotron_labs_diffusion.py`, its LinearSpec
`linear_spec.py`."""

from __future__ import annotations

import json
from pathlib import Path

from .names import ConfigError


def baseline(cls, **overrides):
    """LLaDA's semi-autoregressive baseline: no cache, one token per step, every forward over
    the whole sequence."""
    return cls(
        **{
            "threshold": None,
            "factor": None,
            "cache": "none",
            "suffix_window": None,
            "refresh": "full",
            "refresh_every": None,
            "parallel_blocks": 1,
            **overrides,
        }
    )


def _published(cls, overrides: dict, **fields):
    """A published method's config: what its reference fixes (`fields`) over the layout every
    reference shares (gen length 256 in blocks of 32, its own step rule, no scheduled refresh,
    one block at a time), with `overrides` on top."""
    layout = dict(gen_length=256, block_length=32, steps=None, factor=None, refresh_every=None, parallel_blocks=1)
    return cls(**{**layout, **fields, **overrides})


def fast_dllm(cls, **overrides):
    """Fast-dLLM exactly as published: DualCache, threshold 0.9, a full refresh at every block,
    every forward over the whole sequence; gen length 256 in blocks of 32."""
    return _published(cls, overrides, threshold=0.9, cache="dual", suffix_window=None, refresh="full")


def dparallel(cls, **overrides):
    """dParallel's decoding, as its LLaDA `generate` and Dream `alg="entropy_threshold"`: no
    cache, blocks of 32, every masked position of entropy at most 0.5 nats (always the lowest);
    gen length 256."""
    return _published(
        cls, overrides, threshold=0.5, unmasking="entropy", cache="none", suffix_window=None, refresh="full"
    )


def d3llm(cls, **overrides):
    """d3LLM's decoding (`generate_multi_block`, as its evaluation runs it): no cache, blocks of
    32, every block that takes part (a block joins once the one before it is 10% revealed)
    revealing its positions of entropy at most 0.5 nats, the lowest-entropy position always, and
    the current block at least its own lowest; once an EOS is revealed, everything after it is
    EOS. Gen length 256, so up to 8 blocks at once."""
    return _published(
        cls,
        overrides,
        threshold=0.5,
        unmasking="entropy",
        cache="none",
        suffix_window=None,
        refresh="full",
        parallel_blocks=8,
        block_add_threshold=0.1,
        decoded_token_threshold=0.95,
        stop_at_eos=True,
        eos_early_stop=True,
    )


def dmax(cls, **overrides):
    """DMax's decoding (its dInfer `decode_uniform`): blocks of 32, each step reveals masked
    positions left to right up to the first below 0.5 (at least the first), revises every
    position revealed in the block (`editing_threshold=0`), feeds them back as soft embeddings,
    and ends the block once all are 0.9 likely, nothing changes, or after 32 steps; the
    previous block re-encoded from hard tokens at the next block's first step (the vicinity
    refresh), and nothing after the block in any forward."""
    return _published(
        cls,
        overrides,
        threshold=0.5,
        unmasking="left_to_right",
        cache="dual",
        suffix_window=0,
        refresh="vicinity",
        editing_threshold=0.0,
        stop_confidence=0.9,
        soft_embeddings=True,
    )


def rnd1(cls, **overrides):
    """RND1's decoding (`rnd/sampling.py`'s `diffusion_sample`, with its demo's defaults): the
    answer as one block with no cache, a step per answer position, each step revealing the
    masked positions of lowest entropy so that floor(n (N - 1 - i) / N) of the block's n masks
    stay masked after step i of N; tokens sampled at temperature 0.01 (0: greedy, as its demo's
    `greedy`). Gen length 256."""
    fields = dict(unmasking="rnd1", threshold=None, cache="none", suffix_window=None, refresh="full")
    fields.update(temperature=0.01, block_length=overrides.get("gen_length", 256))
    return _published(cls, overrides, **fields)


def wedlm(cls, **overrides):
    """WeDLM's decoding (Tencent/WeDLM's engine with the settings of its evaluation scripts): a
    window of the 16 positions from the first masked one; each step reveals the window's masks
    whose entropy plus 0.02 per position after its first mask is under 0.4 (at least the lowest),
    greedily; a token is final once every position before it is revealed, and its K/V join an
    exact prefix cache (the model's attention is causal, its masks after its tokens). Gen length
    256 (its `max_tokens`)."""
    fields = dict(unmasking="wedlm", threshold=0.4, block_length=1, cache="prefix", suffix_window=0)
    fields.update(refresh="vicinity", window_size=16, pos_penalty_factor=0.02, temperature=0.0)
    return _published(cls, overrides, **fields)


def _dream_coder(cls, overrides: dict, temperature: float, gen_length: int):
    """Dream's own `diffusion_generate` as a coder's card runs it: the answer as one block with
    no cache, a step per token, Dream's timesteps revealing the lowest-entropy positions
    (`alg="entropy"`, `alg_temp=0`), tokens sampled at `temperature` within top-p 0.95."""
    gen = overrides.get("gen_length", gen_length)
    fields = dict(unmasking="dream_schedule", alg="entropy", alg_temp=None, temperature=temperature, top_p=0.95)
    fields.update(threshold=None, cache="none", suffix_window=None, refresh="full", gen_length=gen, block_length=gen)
    return _published(cls, overrides, **fields)


def diffucoder(cls, **overrides):
    """DiffuCoder's (apple/ml-diffucoder's `inference_demo.py`): temperature 0.3, gen length 256."""
    return _dream_coder(cls, overrides, 0.3, 256)


def dream_coder(cls, **overrides):
    """Dream-Coder's (DreamLM/Dream-Coder's README example): temperature 0.1, gen length 768."""
    return _dream_coder(cls, overrides, 0.1, 768)


def diffusion_gemma(cls, **overrides):
    """DiffusionGemma's decoding (transformers' `DiffusionGemmaForBlockDiffusion.generate` with
    its defaults): canvases of 256 (the model's `canvas_length`), each opened as uniform noise and
    refined for at most 48 steps at a temperature falling from 0.8 to 0.4, each step keeping the
    lowest-entropy samples within an entropy bound of 0.1 and renoising the rest, until its
    argmax holds for a step with a mean entropy under 0.005; the answer is the argmax canvas.
    The prompt and each finished canvas are cached as its encoder computes them (the dual cache
    with the vicinity refresh: each canvas's first forward commits the one before), so a step
    computes the canvas alone, as the reference's decoder does. Gen length 256."""
    fields = dict(unmasking="entropy_bound", threshold=None, cache="dual", suffix_window=0, refresh="vicinity")
    return _published(cls, overrides, **{"block_length": 256, **fields})


def nemotron_labs_diffusion(cls, **overrides):
    """Nemotron-Labs-Diffusion's diffusion mode (its remote code's `generate`, with the settings its
    model card runs): blocks of 32, each opened by the causal pass that commits the block before it
    (its prediction is the block's first token), then every masked position at least 0.9 likely
    (always the most likely) against that cache, until the block holds no mask or a stop token with
    no mask before it; greedy. Gen length 256."""
    fields = dict(threshold=0.9, cache="dual", suffix_window=0, refresh="vicinity", eos_early_stop=True)
    return _published(cls, overrides, **fields)


def nemotron_labs_diffusion_ar(cls, **overrides):
    """Nemotron-Labs-Diffusion's autoregressive mode (its remote code's `ar_generate`): one token per
    causal forward, greedy. Blocks of one position; gen length 256."""
    fields = dict(block_length=1, threshold=None, cache="dual", suffix_window=0, refresh="vicinity")
    return _published(cls, overrides, **fields)


def nemotron_labs_diffusion_linear_spec(cls, **overrides):
    """Nemotron-Labs-Diffusion's LinearSpec self-speculation (its remote code's
    `linear_spec_generate` with its defaults): a bidirectional pass drafts the 31 positions after
    the last token (a block of 32 with it), a causal pass of the same weights verifies them, and the
    longest run of drafts the causal pass agrees with is kept with the causal pass's next token
    after it; the rest are masked again. Greedy; gen length 256."""
    fields = dict(unmasking="linear_spec", window_size=32, block_length=1, threshold=None, cache="dual")
    fields.update(suffix_window=0, refresh="vicinity", temperature=0.0)
    return _published(cls, overrides, **fields)


PRESET_FORMAT = "fastdllm-preset/1"


def read_preset(path, known_fields) -> dict:
    """A preset file: {"format", "family", "model", "task", "config": {field: value}, ...}, whose
    config sets only `known_fields`; a ConfigError naming `preset` when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("preset", f"no preset file {path}") from None
    except (OSError, ValueError) as e:
        raise ConfigError("preset", f"{path} is not a JSON preset ({e})") from None
    if not isinstance(data, dict) or data.get("format") != PRESET_FORMAT or not isinstance(data.get("config"), dict):
        raise ConfigError("preset", f"{path} is not a fastdllm preset (format {PRESET_FORMAT!r} with a config)")
    unknown = sorted(set(data["config"]) - set(known_fields))
    if unknown:
        raise ConfigError("preset", f"{path} sets unknown fields {', '.join(unknown)}")
    return data


# --preset NAME -> what builds its config for a config class: (cls, **overrides) -> config
PRESETS = {
    "default": lambda cls, **overrides: cls(**overrides),
    "fast-dllm": fast_dllm,
    "baseline": baseline,
    "dparallel": dparallel,
    "d3llm": d3llm,
    "dmax": dmax,
    "rnd1": rnd1,
    "diffusion_gemma": diffusion_gemma,
    "diffucoder": diffucoder,
    "dream-coder": dream_coder,
    "wedlm": wedlm,
    "nemotron_labs_diffusion": nemotron_labs_diffusion,
    "nemotron_labs_diffusion_ar": nemotron_labs_diffusion_ar,
    "nemotron_labs_diffusion_linear_spec": nemotron_labs_diffusion_linear_spec,
}


def register_preset(name: str, fields) -> None:
    """Make `GenerationConfig.preset(name)` and `--preset name` a decoder's published settings, from
    the decoder's own file: `fields` a dict of config fields over the layout every published preset
    shares (gen length 256 in blocks of 32, one block at a time, no scheduled refresh), or a
    function (cls, **overrides) -> config. The command line knows it once that file is imported."""
    if name in PRESETS:
        raise ValueError(f"preset: {name!r} is taken")
    if isinstance(fields, dict):
        declared = dict(fields)
        PRESETS[name] = lambda cls, **overrides: _published(cls, overrides, **declared)
    else:
        PRESETS[name] = fields
