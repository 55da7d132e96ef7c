"""Gemma 4's vision encoder (transformers' `Gemma4VisionModel` and the `embed_vision` projection
beside it), as DiffusionGemma's encoder reads images, and its image processor's arithmetic
(`Gemma4ImageProcessorPil`).

An image becomes soft tokens in three parts:
- *processing*: resized (bicubic, by PIL) to the largest size with at most `max_soft_tokens * k^2`
  patches of `patch_size` pixels whose sides are multiples of `k * patch_size` (k the pooling
  kernel), keeping the aspect ratio; scaled to [0, 1]; cut into patches, each flattened row by row
  with the channels last, and each patch's (x, y) on the grid;
- *the tower*: pixels to [-1, 1], a linear patch embedding plus learned x and y embeddings;
  bidirectional layers (q, k RMS-normed with weights, v without, attention scaled by 1, 2-D RoPE:
  the first half of a head rotated by x, the second by y; Gemma's four norms per layer; a GELU-tanh
  gated MLP); then k x k patches averaged into one soft token (in float32), times sqrt(width),
  optionally standardised;
- *the projection*: an RMSNorm without weights and a linear map into the text model's width.

*Deliberate difference*: transformers pads every image to the largest patch count
(`max_soft_tokens * k^2`) and masks the padding; here each image runs alone at its own patch
count: the same arithmetic without the masked keys (equal up to float rounding).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # what its image processor accepts


@dataclass(frozen=True)
class VisionArgs:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    patch_size: int
    pooling: int  # k: k x k patches per soft token
    position_table: int
    clipped: bool  # linear layers clamp their inputs and outputs to stored bounds
    standardize: bool
    text_dim: int
    # the image processor's settings (its processor_config.json, else the defaults)
    max_soft_tokens: int = 280
    rescale: float = 1 / 255

    @classmethod
    def of(cls, vision: dict, text_dim: int) -> VisionArgs:
        """From config.json's `vision_config`, read as `Gemma4VisionConfig` reads it."""
        if vision.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config: field hidden_activation={vision['hidden_activation']!r} is not supported")
        if vision.get("attention_bias"):
            raise ValueError("vision_config: field attention_bias=True is not supported")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config: rope_parameters.rope_type={rope['rope_type']!r} is not supported")
        dim, heads = int(vision.get("hidden_size", 768)), int(vision.get("num_attention_heads", 12))
        return cls(
            dim=dim,
            hidden_dim=int(vision.get("intermediate_size", 3072)),
            n_layers=int(vision.get("num_hidden_layers", 16)),
            n_heads=heads,
            n_kv_heads=int(vision.get("num_key_value_heads", heads)),
            head_dim=int(vision.get("head_dim") or dim // heads),
            norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            patch_size=int(vision.get("patch_size", 16)),
            pooling=int(vision.get("pooling_kernel_size", 3)),
            position_table=int(vision.get("position_embedding_size", 10 * 1024)),
            clipped=bool(vision.get("use_clipped_linears", False)),
            standardize=bool(vision.get("standardize", False)),
            text_dim=text_dim,
        )

    def with_processor(self, folder: Path) -> VisionArgs:
        """The image processor's settings of a checkpoint folder (`processor_config.json`'s
        `image_processor`, or `preprocessor_config.json`), where it has them."""
        settings = {}
        for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
            path = Path(folder) / name
            if path.is_file():
                try:
                    data = json.loads(path.read_text())
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
                settings = (data.get(key) or {}) if key else data
                if settings:
                    break
        for name, mine in (("patch_size", self.patch_size), ("pooling_kernel_size", self.pooling)):
            if settings.get(name, mine) != mine:
                raise ValueError(
                    f"{folder}: the image processor's {name} ({settings[name]}) is not the tower's ({mine})"
                )
        budget = int(settings.get("max_soft_tokens", self.max_soft_tokens))
        if budget not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"{folder}: max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, got {budget}")
        for flag, want in (
            ("do_resize", True),
            ("do_rescale", True),
            ("do_normalize", False),
            ("do_convert_rgb", True),
        ):
            if settings.get(flag, want) != want:
                raise ValueError(f"{folder}: an image processor with {flag}={settings[flag]} is not supported")
        if settings.get("resample", 3) != 3:  # PIL's BICUBIC
            raise ValueError(f"{folder}: an image processor with resample={settings['resample']} is not supported")
        return replace(self, max_soft_tokens=budget, rescale=float(settings.get("rescale_factor", self.rescale)))

    def processor_config(self) -> dict:
        """What `with_processor` reads back (saved beside a checkpoint)."""
        return {
            "image_processor": {
                "image_processor_type": "Gemma4ImageProcessor",
                "patch_size": self.patch_size,
                "pooling_kernel_size": self.pooling,
                "max_soft_tokens": self.max_soft_tokens,
                "rescale_factor": self.rescale,
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": False,
                "do_convert_rgb": True,
                "resample": 3,
            }
        }


# ---- the image processor -----------------------------------------------------------------------


def resized_size(height: int, width: int, args: VisionArgs) -> tuple[int, int]:
    """The size an image is resized to: the largest with at most the budget's patches whose sides
    are multiples of k * patch_size, the aspect ratio kept (a side that would be 0 is one unit,
    the other its ratio of units, capped)."""
    patch, k = args.patch_size, args.pooling
    max_patches = args.max_soft_tokens * k * k
    budget_px = max_patches * patch * patch
    factor = math.sqrt(budget_px / (height * width))
    unit = k * patch
    h, w = int(math.floor(factor * height / unit)) * unit, int(math.floor(factor * width / unit)) * unit
    if h == 0 and w == 0:
        raise ValueError(f"images: a {width}x{height} image is too small to resize to whole {unit}-pixel units")
    longest = (max_patches // (k * k)) * unit
    if h == 0:
        h, w = unit, min(int(math.floor(width / height)) * unit, longest)
    elif w == 0:
        w, h = unit, min(int(math.floor(height / width)) * unit, longest)
    if h * w > budget_px:
        raise ValueError(f"images: a {width}x{height} image resized to {w}x{h} exceeds {max_patches} patches")
    return h, w


def patchify(image, args: VisionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB `PIL.Image` as the tower reads it: (patches (P, patch^2 * 3) in [0, 1] float32, their
    (x, y) on the grid (P, 2)), P a multiple of k^2."""
    from PIL import Image

    h, w = resized_size(image.height, image.width, args)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(image, dtype=np.uint8).astype(np.float64) * args.rescale).astype(np.float32)
    p = args.patch_size
    gh, gw = h // p, w // p
    # (H, W, C) -> (grid rows, grid cols, patch rows, patch cols, C): each patch row by row, channels last
    patches = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
    xs, ys = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    positions = np.stack([xs, ys], axis=-1).reshape(gh * gw, 2)
    return torch.from_numpy(np.ascontiguousarray(patches)), torch.from_numpy(positions).long()


def soft_token_count(image, args: VisionArgs) -> int:
    h, w = resized_size(image.height, image.width, args)
    return (h // args.patch_size) * (w // args.patch_size) // (args.pooling**2)


# ---- the tower ---------------------------------------------------------------------------------


def gemma_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: in float32, x * (mean x^2 + eps)^-0.5, times the weight where it has one."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (out if weight is None else out * weight.float()).type_as(x)


class ClippedLinear(nn.Linear):
    """A linear layer without bias; with `clipped`, its input and output clamped to stored bounds."""

    def __init__(self, n_in: int, n_out: int, clipped: bool):
        super().__init__(n_in, n_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                sign = -1 if name.endswith("min") else 1
                self.register_buffer(name, torch.tensor(sign * float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return super().forward(x)
        return super().forward(x.clamp(self.input_min, self.input_max)).clamp(self.output_min, self.output_max)


def _rotate_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (P, heads, d): its first half rotated by the x angles, its second by the y angles
    (cos/sin (P, d): [x, x, y, y] quarters), each half as rotate_half rotates a head."""
    halves = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1)):
        a, b = part.chunk(2, -1)
        halves.append(part * c[:, None] + torch.cat((-b, a), -1) * s[:, None])
    return torch.cat(halves, -1)


class VisionLayer(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.a = a
        d, hd = a.dim, a.head_dim
        self.wq = ClippedLinear(d, a.n_heads * hd, a.clipped)
        self.wk = ClippedLinear(d, a.n_kv_heads * hd, a.clipped)
        self.wv = ClippedLinear(d, a.n_kv_heads * hd, a.clipped)
        self.wo = ClippedLinear(a.n_heads * hd, d, a.clipped)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.w1 = ClippedLinear(d, a.hidden_dim, a.clipped)  # gate
        self.w3 = ClippedLinear(d, a.hidden_dim, a.clipped)  # up
        self.w2 = ClippedLinear(a.hidden_dim, d, a.clipped)  # down
        for name in ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"):
            self.register_parameter(name, nn.Parameter(torch.ones(d)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, n = self.a, x.shape[0]
        h = gemma_norm(x, self.attention_norm, a.norm_eps)
        q = _rotate_2d(gemma_norm(self.wq(h).view(n, a.n_heads, a.head_dim), self.q_norm, a.norm_eps), cos, sin)
        k = _rotate_2d(gemma_norm(self.wk(h).view(n, a.n_kv_heads, a.head_dim), self.k_norm, a.norm_eps), cos, sin)
        v = gemma_norm(self.wv(h).view(n, a.n_kv_heads, a.head_dim), None, a.norm_eps)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            scale=1.0,
            enable_gqa=a.n_kv_heads != a.n_heads,
        )
        x = x + gemma_norm(self.wo(out[0].transpose(0, 1).reshape(n, -1)), self.post_attention_norm, a.norm_eps)
        h = gemma_norm(x, self.ffn_norm, a.norm_eps)
        mlp = self.w2(F.gelu(self.w1(h), approximate="tanh") * self.w3(h))
        return x + gemma_norm(mlp, self.post_ffn_norm, a.norm_eps)


def vision_weight_names(a: VisionArgs, prefix: str) -> dict[str, str]:
    """A tower's parameters (under `prefix`, its attribute) -> transformers' names in a DiffusionGemma checkpoint."""
    tower = "model.encoder.vision_tower"
    names = {
        "patch_embedding.weight": f"{tower}.patch_embedder.input_proj.weight",
        "position_embedding": f"{tower}.patch_embedder.position_embedding_table",
        "projection.weight": "model.encoder.embed_vision.embedding_projection.weight",
    }
    if a.standardize:
        names.update({"std_bias": f"{tower}.std_bias", "std_scale": f"{tower}.std_scale"})
    linears = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj"}
    linears.update({"w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"})
    norms = {
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "attention_norm": "input_layernorm.weight",
        "post_attention_norm": "post_attention_layernorm.weight",
        "ffn_norm": "pre_feedforward_layernorm.weight",
        "post_ffn_norm": "post_feedforward_layernorm.weight",
    }
    for i in range(a.n_layers):
        theirs = f"{tower}.encoder.layers.{i}"
        for ours, t in linears.items():
            names[f"layers.{i}.{ours}.weight"] = f"{theirs}.{t}.linear.weight"
            if a.clipped:
                for bound in ("input_min", "input_max", "output_min", "output_max"):
                    names[f"layers.{i}.{ours}.{bound}"] = f"{theirs}.{t}.{bound}"
        for ours, t in norms.items():
            names[f"layers.{i}.{ours}"] = f"{theirs}.{t}"
    return {f"{prefix}.{k}": v for k, v in names.items()}


class GemmaVision(nn.Module):
    """Images to soft tokens in the text model's width (`image_features`)."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.a = a
        self.patch_embedding = nn.Linear(3 * a.patch_size**2, a.dim, bias=False)
        self.position_embedding = nn.Parameter(torch.ones(2, a.position_table, a.dim))
        self.layers = nn.ModuleList(VisionLayer(a) for _ in range(a.n_layers))
        if a.standardize:
            self.register_buffer("std_bias", torch.zeros(a.dim))
            self.register_buffer("std_scale", torch.ones(a.dim))
        self.projection = nn.Linear(a.dim, a.text_dim, bias=False)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.a
        spatial = a.head_dim // 2  # each axis's share of a head
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (P, 2, d/4)
        fx, fy = freqs[:, 0], freqs[:, 1]
        angles = torch.cat([fx, fx, fy, fy], -1)
        dtype = self.patch_embedding.weight.dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image's patches (P, patch^2 * 3) in [0, 1] and their grid (P, 2) -> its soft tokens
        (P / k^2, text width), row by row over the pooled grid."""
        a, dev = self.a, self.patch_embedding.weight.device
        patches, positions = patches.to(dev), positions.to(dev)
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding((2 * (patches - 0.5)).to(dtype))
        x = x + self.position_embedding[0][positions[:, 0]] + self.position_embedding[1][positions[:, 1]]
        cos, sin = self._angles(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        n, k = x.shape[0], a.pooling
        if n % (k * k):
            raise ValueError(f"images: {n} patches do not pool in {k}x{k} groups")
        out = n // (k * k)
        if k > 1:  # each k x k group of the grid averaged into one soft token, in float32
            cells = positions // k
            cell = cells[:, 0] + (int(positions[:, 0].max()) + 1) // k * cells[:, 1]
            weights = F.one_hot(cell, out).float() / (k * k)
            x = (weights.T @ x.float()).to(x.dtype)
        x = x.float() * math.sqrt(a.dim)
        if a.standardize:
            x = (x - self.std_bias.float()) * self.std_scale.float()
        x = x.to(dtype)
        return self.projection(gemma_norm(x, None, a.norm_eps))
