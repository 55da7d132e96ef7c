"""Nemotron-Labs-Diffusion (nvidia/Nemotron-Labs-Diffusion-*, `NemotronLabsDiffusionModel`, model_type
`nemotron_labs_diffusion`): a Ministral-3 body with an untied `diffusion_head`, run causally or
bidirectionally by the same weights.

Ministral 3's layers are Llama's (RMSNorm, SwiGLU, grouped-query attention without biases, an explicit
head width), with YaRN RoPE (`rope_parameters`: the inverse frequencies blended between the
original and the `factor`-scaled ones over YaRN's correction range, cos and sin times its
attention factor) and Llama 4's query scale after RoPE, 1 + beta log(1 + floor(position /
original_max_position_embeddings)): 1 below the original context.

Its remote code decodes three ways, switching each layer's attention between causal and
bidirectional (`diffusion_lm`) per pass: `ar_generate` (causal, one token per forward), `generate`
(blocks: a causal pass writes the cache and predicts the block's first token, bidirectional passes
over the block against that cache reveal the rest by confidence) and `linear_spec_generate`
(a bidirectional draft of a block, verified by a causal pass). Here a window's columns before its
logits' first column are computed causally (the prompt and a finished block, committed to the
cache) and the columns from it bidirectionally as the block being decoded (the canvas: it sees
the causal cache and the whole block, nothing after it); the logit of the window's first
position is the causal prediction of the column before it, the others the canvas's own. The
autoregressive mode is blocks of one position.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .family import ConfigField, DecodingRules, Family, WeightNames
from .invariance import BatchInvariant
from .transformer import Transformer, block_causal_mask, positions_from_mask, rope_tables_of

MODEL_TYPE = "nemotron_labs_diffusion"

# nvidia/Nemotron-Labs-Diffusion-3B's config.json.
REFERENCE_CONFIG = {
    "architectures": ["NemotronLabsDiffusionModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_implementation": "sdpa",
    "auto_map": {
        "AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
        "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel",
    },
    "block_size": 32,
    "bos_token_id": 1,
    "dlm_loss_weight": None,
    "dlm_paradigm": "bidirectional",
    "dp_varying_mask_ratio": False,
    "eos_token_id": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 9216,
    "mask_token_id": 100,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "model_type": MODEL_TYPE,
    "num_attention_heads": 32,
    "num_hidden_layers": 26,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 0.25,
        "llama_4_scaling_beta": 0.1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16384,
        "rope_theta": 1000000.0,
        "rope_type": "yarn",
    },
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 131072,
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rope: dict, head_dim: int, max_positions: int, device=None) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor from `rope_parameters`, as transformers
    computes them (`_compute_yarn_parameters`), in float32."""
    base = float(rope["rope_theta"])
    factor = rope.get("factor")
    original = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim else _yarn_mscale(factor)
        )
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device=device).to(dtype=torch.float) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class NemotronLabsDiffusion(Transformer):
    """The model (see the module's docstring). `forward` and `logits_for` are its causal pass (its
    autoregressive likelihood, logits shifted); `packed_logits`, the loop's forward, computes a
    window's committed columns causally and its block bidirectionally."""

    two_passes = True
    causal_prompt = True  # its prompt is always its causal pass's
    mixes_block_lengths = True  # a row's block sets its own window's span alone

    def setup_rope(self, device=None) -> None:
        if device is None:
            device = self.tok_embeddings.weight.device
            if device.type == "meta":
                device = torch.device("cpu")
        rope = self.args.extra.get("rope") or {"rope_theta": self.args.rope_theta}
        if rope.get("rope_type", "default") == "yarn":
            inv_freq, attention = yarn_inv_freq(rope, self.args.head_dim, self.args.max_seq_len, device)
        else:
            theta = float(rope["rope_theta"])
            dims = torch.arange(0, self.args.head_dim, 2, dtype=torch.float, device=device)
            inv_freq = 1.0 / (theta ** (dims / self.args.head_dim))
            attention = 1.0
        cos, sin = rope_tables_of(inv_freq, self.args.max_seq_len, device)
        self.register_buffer("rope_cos", cos * attention, persistent=False)
        self.register_buffer("rope_sin", sin * attention, persistent=False)
        beta, original = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        scale = None
        if beta and original and self.args.max_seq_len > original:  # else 1 at every position
            positions = torch.arange(self.args.max_seq_len, device=device, dtype=torch.float32)
            scale = 1 + beta * torch.log(1 + torch.floor(positions / original))
        self.register_buffer("q_scales", scale, persistent=False)

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None if self.q_scales is None else self.q_scales[positions][:, None, :, None]

    def window_mask(self, x, row, lo, hi, keys, start, block_size, span=None):
        """Columns before `start` causal; from it a span of `span` positions (default: the block,
        `block_size`) sees every key before its end; `span` 0: the whole window causal (a
        speculative draft's verification)."""
        span = block_size or hi - start if span is None else span
        cols = torch.arange(lo, hi, device=x.device)[:, None]
        k = torch.arange(keys, device=x.device)[None, :]
        causal = k <= cols
        mask = causal if span == 0 else torch.where(cols < start, causal, k < start + span)
        return None if bool(mask.all()) else mask

    def fits_fixed_form(self, seq, windows: list) -> bool:
        """Not for rows of other block lengths in one step: its fixed-shape mask reads one."""
        return not isinstance(seq.block_size, dict)

    def static_key_mask(self, positions, key_ok, key_positions, block_size, starts, spans):
        """A fixed-shape window's mask (`Transformer.static_key_mask`) by this model's rule for a
        window (`window_mask`): a column before the row's first logit column (`starts`) sees the
        keys up to itself (causal: a finished block being committed), a column from it on every
        key before the end of its span: the row's `spans` entry where its decoder chose one (0: the
        whole window causal, a speculative draft's verification), else its block (`block_size`
        columns; None: the end of the window, its padding at its last column), whatever else the
        step sees."""
        block_start, chosen = starts[:, None, None], spans[:, None, None]
        block_end = block_start + block_size if block_size else positions.amax(1)[:, None, None] + 1
        block_end = torch.where(chosen >= 0, block_start + chosen, block_end)
        keys, queries = key_positions[:, None, :], positions[:, :, None]
        causal = keys <= queries
        spanned = (keys < block_end) & (causal | (queries >= block_start))
        return (key_ok[:, None, :] & torch.where(chosen == 0, causal, spanned))[:, None]

    def logit_columns(self, lo, hi, start, span=None):
        """The first position's logit from the causal column before it (where the window holds it);
        the others from their own columns in the bidirectional span, or from the column before
        each in a window causal throughout (`span` 0)."""
        first = start - 1 - lo if lo < start else 0
        shift = 1 if span == 0 else 0
        return torch.cat([torch.tensor([first]), torch.arange(start + 1 - shift - lo, hi - shift - lo)])

    def forward(self, input_ids, attention_mask=None, batch_invariant=False, adapters=None):
        """The causal pass: logits (B, L, V), shifted (position i's predicts token i + 1)."""
        if adapters is not None:
            raise ValueError("adapters: not in Nemotron-Labs-Diffusion's plain forward")
        bsz, length = input_ids.shape
        positions = positions_from_mask(attention_mask, bsz, length, input_ids.device)
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        key_mask = block_causal_mask(positions, positions, 1, key_mask)
        with BatchInvariant() if batch_invariant else contextlib.nullcontext():
            return self.head(self.hidden(input_ids, positions, key_mask, batch_invariant=batch_invariant))

    def logits_for(self, x, start, end, *, positions=None, key_mask=None, block_size=None, batch_invariant=False):
        """Logits (B, end - start, V) of positions [start, end) from the causal pass over `x`."""
        bsz, length = x.shape
        if not (1 <= start < end <= length):
            raise ValueError(f"logits for [{start}, {end}) are not in a sequence of {length}")
        if positions is None:
            positions = positions_from_mask(None, bsz, length, x.device)
        key_mask = block_causal_mask(positions, positions, 1, key_mask)
        with BatchInvariant() if batch_invariant else contextlib.nullcontext():
            h = self.hidden(x, positions, key_mask, batch_invariant=batch_invariant)
            return self.head(h[:, start - 1 : end - 1])


# ---- the checkpoint -------------------------------------------------------------------------------


def _rope_of(cfg: dict) -> dict:
    """The RoPE parameters as its config class reads them: `rope_parameters`, or the older
    `rope_scaling` with a top-level `rope_theta`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def _check(cfg: dict, where: str) -> None:
    paradigm = cfg.get("dlm_paradigm", "bidirectional")
    if paradigm not in ("bidirectional", "autoregressive"):
        raise ValueError(
            f"{where}: field dlm_paradigm={paradigm!r} is not supported (its block_diff attention is a training layout)"
        )
    rope = _rope_of(cfg)
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise ValueError(f"{where}: field rope_parameters.rope_type={rope['rope_type']!r} is not supported")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: field rope_parameters.partial_rotary_factor is not supported")


def _adjust(cfg: dict, values: dict) -> None:
    rope = _rope_of(cfg)
    values["rope_theta"] = float(rope["rope_theta"])
    values["extra"] = {"rope": rope}


FAMILY = Family(
    name="Nemotron-Labs-Diffusion",
    model_type=MODEL_TYPE,
    shifted_logits=True,  # a causal column predicts the next position
    reference_config=REFERENCE_CONFIG,
    required=("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"),
    fields={
        "dim": ConfigField(("hidden_size",)),
        "n_layers": ConfigField(("num_hidden_layers",)),
        "n_heads": ConfigField(("num_attention_heads",)),
        "n_kv_heads": ConfigField(("num_key_value_heads",), default=lambda v: v["n_heads"]),
        "head_size": ConfigField(("head_dim",), default=lambda v: v["dim"] // v["n_heads"]),
        "hidden_dim": ConfigField(("intermediate_size",)),
        "vocab_size": ConfigField(("vocab_size",)),
        "max_seq_len": ConfigField(("max_position_embeddings",), default=262_144),
        "norm_eps": ConfigField(("rms_norm_eps",), float, 1e-5),
        "mask_token_id": ConfigField(("mask_token_id",), default=100),
        "eos_token_id": ConfigField(("eos_token_id",), default=2),
    },
    unsupported={
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    check=_check,
    adjust=_adjust,
    derived=lambda a: {
        "head_dim": a.head_dim,
        "rope_parameters": a.extra.get("rope") or {"rope_theta": a.rope_theta, "rope_type": "default"},
    },
    weights=WeightNames(
        top={
            "tok_embeddings.weight": "encoder.embed_tokens.weight",
            "norm.weight": "encoder.norm.weight",
            "output.weight": "diffusion_head.weight",
        },
        layer={
            "layers.{i}.attention_norm.weight": "encoder.layers.{i}.input_layernorm.weight",
            "layers.{i}.ffn_norm.weight": "encoder.layers.{i}.post_attention_layernorm.weight",
            "layers.{i}.attention.w{p}.weight": "encoder.layers.{i}.self_attn.{p}_proj.weight",
            "layers.{i}.attention.wo.weight": "encoder.layers.{i}.self_attn.o_proj.weight",
            "layers.{i}.feed_forward.w1.weight": "encoder.layers.{i}.mlp.gate_proj.weight",
            "layers.{i}.feed_forward.w3.weight": "encoder.layers.{i}.mlp.up_proj.weight",
            "layers.{i}.feed_forward.w2.weight": "encoder.layers.{i}.mlp.down_proj.weight",
        },
    ),
    model_class=NemotronLabsDiffusion,
    bundled_adapters=("linear_spec_lora",),
    rules=DecodingRules(
        published="nemotron_labs_diffusion",
        proposal="nemotron_labs_diffusion",
        block_start_reveals_first=True,
    ),
)
