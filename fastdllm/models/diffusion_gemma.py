"""DiffusionGemma (google/diffusiongemma-*, `DiffusionGemmaForBlockDiffusion`, transformers'
`models/diffusion_gemma`): Gemma 4's text layers run as a block-diffusion model with no mask token.

One weight set serves two passes. The *encoder* pass is causal: the prompt, and each canvas once it
is final, written into the K/V cache. The *decoder* pass refines the current canvas (a block of
`canvas_length` positions, 256 published) bidirectionally, attending to that cache without writing
it. Its input is the canvas's tokens plus a self-conditioning signal: the previous step's logits,
softmaxed, times the embedding matrix, through a small gated MLP (zeros at a canvas's first step).

Gemma 4's layers: sliding-window layers (their own head width, RoPE over the whole head) and full
layers (a wider head, fewer K/V heads, K = V: the key projection is the value before its norms, and
"proportional" RoPE that rotates the first quarter of the frequencies); q and k RMS-normed with
weights, v without; attention scaled by 1; a dense GELU-tanh MLP and a mixture of experts side by
side in every layer, each with its own norms; per-layer scalars; embeddings scaled by sqrt(dim) in
the weights' dtype; final logits soft-capped by tanh. RMSNorm is Gemma's: in float32, x times
(mean x^2 + eps)^-0.5, times the weight.

A forward computes a window of a row: its columns before the current canvas as the encoder does
(causal; a sliding layer sees the last `sliding_window` positions up to itself), the canvas as the
decoder does (every earlier position, in a sliding layer the last `sliding_window - 1` before the
canvas, and the whole canvas), their K/V written into the row's pages of the pool. With the dual
cache and the vicinity refresh a canvas's first forward commits the canvas before it (recomputed
causally) and later steps compute the canvas alone: the arithmetic of transformers' encoder and
decoder over its cache. The pool keeps a layer's K/V per position flattened to the widest
layer's width.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..text.images import open_image
from .args import ModelArgs
from .family import ConfigField, DecodingRules, Family, WeightNames
from .gemma_vision import GemmaVision, VisionArgs, gemma_norm, patchify, soft_token_count, vision_weight_names
from .invariance import BatchInvariant
from .moe import _grouped_mm_ok, expert_linear
from .packed import PackedRows, one_call
from .transformer import Transformer, rope_tables_of

MODEL_TYPE = "diffusion_gemma"
SLIDING, FULL = "sliding_attention", "full_attention"


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GemmaNorm(nn.Module):
    """Gemma 4's RMSNorm: float32, x * (mean(x^2) + eps)^-0.5, times the weight where it has one."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_norm(x, self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the input's dtype, as Gemma's apply_rotary_pos_emb: x (1, N, heads, d), cos/sin (N, d)."""
    cos, sin = cos.to(x.dtype)[None, :, None], sin.to(x.dtype)[None, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention_masks(q, k, start, seen, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys (positions `k`) each query (positions `q`) of a row attends in a full and in a
    sliding layer (broadcast shapes): before its canvas (from `start`) causally, the canvas every
    key `seen` allows, a sliding layer's window ending at the query or for the canvas at its start."""
    full = ((k <= q) | (q >= start)) & seen
    return full, full & (k >= torch.minimum(q, start) - window + 1)


class FixedPlan:
    """How the rows of a fixed-shape step attend (`DiffusionGemma.window_logits_static`): each
    row's window of T columns at `positions` (B, T) over its cache row's S keys, with `full` and
    `sliding` (B, 1, T, S) its masks in the two kinds of layer (`attention_masks`, the keys past
    what the row sees masked by `key_ok` (B, S)), its K/V written at its cache `columns` (B, T)."""

    def __init__(self, positions, starts, key_ok, key_positions, columns, window: int):
        full, sliding = attention_masks(
            positions[:, :, None], key_positions[:, None, :], starts[:, None, None], key_ok[:, None, :], window
        )
        self.full, self.sliding, self.columns = full[:, None], sliding[:, None], columns


class AttentionPlan:
    """How a forward's packed rows attend, built once and shared by its layers: row r's queries
    are its window's columns [lo, hi) and its keys its columns [0, keys) (`key_slots`: their
    places, a padded table, and their counts);
    `full` and `sliding` are its masks in the two kinds of layer: causal before its canvas (from
    `start`), the canvas seeing everything, a sliding layer's window ending at the query or for
    the canvas at its start, and an image's columns (`groups`, rows x keys: the image of each
    column, -1 for text) seeing each other. With `one_call` every row attends in one call per
    layer (`packed.PackedRows`); else a call per row at its own shapes (`rows`: offset, width,
    key slots, masks)."""

    def __init__(self, windows: list, key_slots: tuple, groups, window: int, device, one_call: bool):
        lo, hi, keys, start = torch.tensor(list(zip(*windows))[1:], device=device)
        widths = [b - a for _, a, b, _, _ in windows]
        table, counts = key_slots
        width, most = max(widths), table.shape[1]
        q = lo[:, None, None] + torch.arange(width, device=device)[None, :, None]  # (rows, queries, 1)
        k = torch.arange(most, device=device)[None, None, :]
        seen = k < keys[:, None, None]
        full, sliding = attention_masks(q, k, start[:, None, None], seen, window)
        if groups is not None:
            g_q = groups.gather(1, q[..., 0].clamp(max=groups.shape[1] - 1))
            same = (g_q[:, :, None] == groups[:, None, :most]) & (g_q[:, :, None] >= 0) & seen
            full, sliding = full | same, sliding | same
        self.packed = PackedRows(widths, table, counts, device) if one_call else None
        if one_call:
            self.full, self.sliding = self.packed.mask(full), self.packed.mask(sliding)
            return
        offsets = [0, *itertools.accumulate(widths)][:-1]
        self.rows = [
            (o, w, table[r, :n], full[r, :w, :n][None, None], sliding[r, :w, :n][None, None])
            for r, (o, w, n) in enumerate(zip(offsets, widths, counts))
        ]


class GemmaAttention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        e = args.extra
        self.sliding = sliding
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim if sliding else e["full_head_dim"]
        self.n_kv_heads = args.n_kv_heads if sliding else e["full_kv_heads"]
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False) if sliding else None
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = GemmaNorm(self.head_dim, args.norm_eps)
        self.k_norm = GemmaNorm(self.head_dim, args.norm_eps)
        self.v_norm = GemmaNorm(self.head_dim, args.norm_eps, scale=False)

    def project(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values (1, N, heads, d) of x (1, N, dim): normed, and rotated but V."""
        n = x.shape[1]
        q = _rotate(self.q_norm(self.wq(x).view(1, n, self.n_heads, self.head_dim)), cos, sin)
        raw_k = self.wk(x).view(1, n, self.n_kv_heads, self.head_dim)
        raw_v = raw_k if self.wv is None else self.wv(x).view(1, n, self.n_kv_heads, self.head_dim)
        return q, _rotate(self.k_norm(raw_k), cos, sin), self.v_norm(raw_v)

    def forward(self, q, k, v, plan: AttentionPlan, layer_cache=None, slots=None) -> torch.Tensor:
        """The packed rows' attention output (1, N, dim) from their projections (`project`): their
        K/V written into the pool at `slots` in one copy (`PagedKVCache.write_slots`;
        `layer_cache`: one layer of the pool, each position's K/V flattened to its width; None: the
        windows' own K/V, which start at column 0), then every row's queries attending over its
        keys in one call (`AttentionPlan`)."""
        n = q.shape[1]
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(plan, FixedPlan):
            return self._fixed(q, k, v, plan, layer_cache, gqa)
        if layer_cache is None:  # the windows' own K/V, packed
            sources = (k[0], v[0])
        else:  # the pool's, each position flattened to the widest layer's width
            layer_cache.write(slots, self._flat(k, layer_cache), self._flat(v, layer_cache))
            width = self.n_kv_heads * self.head_dim
            sources = (layer_cache.k[0][..., :width], layer_cache.v[0][..., :width])

        def gather(source: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
            picked = source[where]
            return picked if layer_cache is None else picked.unflatten(-1, (self.n_kv_heads, self.head_dim))

        if plan.packed is not None:
            keys, values = gather(sources[0], plan.packed.keys), gather(sources[1], plan.packed.keys)
            mask = plan.sliding if self.sliding else plan.full
            return self.wo(plan.packed.attend(q[0], keys, values, mask, scale=1.0, gqa=gqa).reshape(1, n, -1))
        out = torch.empty_like(q[0])
        for offset, w, where, full, sliding in plan.rows:
            out[offset : offset + w] = F.scaled_dot_product_attention(
                q[0, offset : offset + w].transpose(0, 1)[None],
                gather(sources[0], where).transpose(0, 1)[None],
                gather(sources[1], where).transpose(0, 1)[None],
                attn_mask=sliding if self.sliding else full,
                scale=1.0,
                enable_gqa=gqa,
            )[0].transpose(0, 1)
        return self.wo(out.reshape(1, n, -1))

    def _fixed(self, q, k, v, plan: FixedPlan, layer_cache, gqa: bool) -> torch.Tensor:
        """`forward` for a fixed-shape step's rows (B, T), packed one after another in q, k, v:
        their K/V written at the plan's columns, each row attending over its cache row's keys."""
        (bsz, t), n = plan.columns.shape, q.shape[1]
        width = self.n_kv_heads * self.head_dim
        rows = (self._flat(x.view(bsz, t, self.n_kv_heads, self.head_dim), layer_cache) for x in (k, v))
        keys, values = layer_cache.update(plan.columns, *rows)
        keys, values = (x[:, 0, :, :width].unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
                        for x in (keys, values))  # fmt: skip
        out = F.scaled_dot_product_attention(
            q.view(bsz, t, self.n_heads, self.head_dim).transpose(1, 2),
            keys,
            values,
            attn_mask=plan.sliding if self.sliding else plan.full,
            scale=1.0,
            enable_gqa=gqa,
        )
        return self.wo(out.transpose(1, 2).reshape(1, n, -1))

    def _flat(self, t: torch.Tensor, layer_cache) -> torch.Tensor:
        """(B, T, heads, d) as the pool keeps a position: (B, 1, T, width), zero-padded."""
        flat = t.reshape(t.shape[0], 1, t.shape[1], -1)
        return F.pad(flat, (0, layer_cache.k.shape[-1] - flat.shape[-1]))


class GemmaLayer(nn.Module):
    """Attention, then a dense MLP and a mixture of experts side by side, each between its own norms;
    the layer's output times its scalar (the encoder's and the decoder's are separate buffers)."""

    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        e = args.extra
        dim, eps = args.dim, args.norm_eps
        self.attention_norm = GemmaNorm(dim, eps)
        self.attention = GemmaAttention(args, e["layer_types"][index] == SLIDING)
        self.post_attention_norm = GemmaNorm(dim, eps)
        self.ffn_norm = GemmaNorm(dim, eps)
        self.w1 = nn.Linear(dim, args.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, args.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(args.hidden_dim, dim, bias=False)  # down
        self.post_ffn_norm_1 = GemmaNorm(dim, eps)
        self.router_norm = GemmaNorm(dim, eps, scale=False)
        self.router_scale = nn.Parameter(torch.ones(dim))
        self.router = nn.Linear(dim, args.n_experts, bias=False)
        self.per_expert_scale = nn.Parameter(torch.ones(args.n_experts))
        self.experts_gate_up = nn.Parameter(torch.empty(args.n_experts, 2 * args.moe_hidden_dim, dim))
        self.experts_down = nn.Parameter(torch.empty(args.n_experts, dim, args.moe_hidden_dim))
        self.experts_norm = GemmaNorm(dim, eps)
        self.post_ffn_norm_2 = GemmaNorm(dim, eps)
        self.post_ffn_norm = GemmaNorm(dim, eps)
        self.register_buffer("decoder_scalar", torch.ones(1))
        self.register_buffer("encoder_scalar", torch.ones(1))
        self.top_k = args.n_active_experts
        self.reduce_ffn = None  # under tensor parallelism: sums the ranks' partial MLP outputs

    def experts(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The routed experts of each token (N, dim): chosen from the un-normed residual, as Gemma 4
        routes, and run on `x` (the residual after the experts' own norm)."""
        h = self.router_norm(residual) * self.router_scale * (residual.shape[-1] ** -0.5)
        probs = self.router(h).softmax(-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.per_expert_scale[chosen]
        grouped = x.dtype in (torch.float32, torch.bfloat16, torch.float16)  # what grouped_mm takes
        if not (grouped and _grouped_mm_ok(x, self.experts_gate_up, self.experts_down)):
            return self._experts_one_by_one(x, chosen, weights)
        # every (token, expert) pair through one grouped matmul per projection, sorted by expert,
        # with no host read; a token's experts then added in expert order, as the reference adds them
        n, k = chosen.shape
        pairs = chosen.reshape(-1)
        order = pairs.argsort(stable=True)
        counts = torch.zeros(self.experts_gate_up.shape[0], dtype=torch.int32, device=x.device)
        counts.index_add_(0, pairs, torch.ones_like(pairs, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        rows, experts = x[order // k], pairs[order]
        gate, up = expert_linear(rows, self.experts_gate_up, offsets, experts, True).chunk(2, dim=-1)
        y = expert_linear(_gelu(gate) * up, self.experts_down, offsets, experts, True)
        per_pair = torch.empty_like(y)
        per_pair[order] = y
        per_pair = (per_pair.view(n, k, -1) * weights.unsqueeze(-1)).to(x.dtype)
        by_expert = chosen.argsort(dim=-1, stable=True)
        per_pair = per_pair.gather(1, by_expert.unsqueeze(-1).expand_as(per_pair))
        out = torch.zeros_like(x)
        for slot in range(k):
            out = out + per_pair[:, slot]
        return out

    def _experts_one_by_one(self, x, chosen, weights) -> torch.Tensor:
        """Expert by expert, as the reference's eager path (where a grouped matmul cannot run: float64,
        unaligned widths)."""
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(x[token], self.experts_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(_gelu(gate) * up, self.experts_down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def before_attention(self, x, cos, sin):
        return self.attention.project(self.attention_norm(x), cos, sin)

    def after_attention(self, x, attended):
        """The residual after attention, the dense MLP's output, and the experts' input and router
        input (the experts themselves run apart: their grouped matmul is not compiled)."""
        x = x + self.post_attention_norm(attended)
        normed = self.ffn_norm(x)
        dense = self.w2(_gelu(self.w1(normed)) * self.w3(normed))
        flat = x.reshape(-1, x.shape[-1])
        return x, dense, self.experts_norm(flat), flat

    def after_experts(self, x, dense, routed, canvas):
        x = x + self.post_ffn_norm(self.post_ffn_norm_1(dense) + self.post_ffn_norm_2(routed))
        scalar = torch.where(canvas[None, :, None], self.decoder_scalar, self.encoder_scalar).to(x.dtype)
        return x * scalar

    def forward(self, x, cos, sin, plan, canvas: torch.Tensor, layer_cache=None, slots=None, dense=None):
        """`dense`: the layer's dense math (`before_attention`, `after_attention`,
        `after_experts`) through torch.compile (`DiffusionGemma.compiled_layers`); None: eager."""
        before, after, finish = dense or (self.before_attention, self.after_attention, self.after_experts)
        attended = self.attention(*before(x, cos, sin), plan, layer_cache, slots)
        x, mlp, normed, flat = after(x, attended)
        routed = self.experts(normed, flat).view_as(x)
        if self.reduce_ffn is not None:  # each rank holds a slice of both MLPs' hidden units
            mlp, routed = self.reduce_ffn(torch.stack((mlp, routed))).unbind(0)
        return finish(x, mlp, routed, canvas)


def _inv_freq(head_dim: int, theta: float, rotary: float | None, device=None) -> torch.Tensor:
    """Default RoPE (rotary None) over the whole head, or Gemma 4's proportional RoPE: the first
    `rotary` share of the frequencies as the whole head's, the rest 0 (those dims pass through)."""
    if rotary is None:
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    angles = int(rotary * head_dim // 2)
    steps = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).to(torch.float)
    return torch.cat([1.0 / (theta ** (steps / head_dim)), torch.zeros(head_dim // 2 - angles, device=device)])


class DiffusionGemma(Transformer):
    """The model (see the module's docstring). `packed_logits` is the loop's forward; `forward` the
    encoder's causal pass over whole sequences (what a likelihood reads)."""

    def make_layers(self, args: ModelArgs) -> nn.ModuleList:
        return nn.ModuleList(GemmaLayer(args, i) for i in range(args.n_layers))

    def make_extra(self, args: ModelArgs) -> None:
        vision = args.extra.get("vision")
        self.vision = None if vision is None else GemmaVision(VisionArgs.of(vision, args.dim))
        self.norm = GemmaNorm(args.dim, args.norm_eps)
        self.sc_norm = GemmaNorm(args.dim, args.norm_eps)
        self.sc_w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.sc_w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.sc_w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.sc_post_norm = GemmaNorm(args.dim, args.norm_eps, scale=False)

    def setup_rope(self, device=None) -> None:
        if device is None:
            device = self.tok_embeddings.weight.device
            if device.type == "meta":
                device = torch.device("cpu")
        a, e = self.args, self.args.extra
        for name, head, theta, rotary in (
            ("sliding", a.head_dim, a.rope_theta, None),
            ("full", e["full_head_dim"], e["full_rope_theta"], e["full_rotary"]),
        ):
            cos, sin = rope_tables_of(_inv_freq(head, theta, rotary, device), a.max_seq_len, device)
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    def tp_cuts(self, rank: int, world: int, ep: int = 1) -> dict:
        """Per parameter that tensor parallelism splits, the part rank `rank` of `world` keeps
        (`models.tp.Cut`): each layer's q heads and its output projection's input columns, its
        kv heads (the one its q heads read where a layer has fewer than the ranks: a full layer's
        single K = V head), and the hidden units of its dense MLP and of every expert (gate and up
        rows, down columns). The embeddings, norms, router and self-conditioning MLP stay whole."""
        from .tp import check_split

        a, e = self.args, self.args.extra
        for kv in (a.n_kv_heads, e["full_kv_heads"]):
            check_split(replace(a, n_kv_heads=kv), world, 1)
        if ep != 1:
            raise ValueError("ep: not yet for DiffusionGemma (its experts are split by tensor parallelism: ep=1)")
        for name in ("hidden_dim", "moe_hidden_dim"):
            if getattr(a, name) % world:
                raise ValueError(f"tp: {world} does not divide the MLP's {name} ({getattr(a, name)})")

        def part(width: int) -> tuple[int, int]:
            return rank * width // world, (rank + 1) * width // world

        h, hidden, moe = a.n_heads // world, part(a.hidden_dim), part(a.moe_hidden_dim)
        out = {}
        for i, kind in enumerate(e["layer_types"]):
            hd, kv_n = (a.head_dim, a.n_kv_heads) if kind == SLIDING else (e["full_head_dim"], e["full_kv_heads"])
            if kv_n >= world:
                kv = part(kv_n * hd)
            else:  # the kv head this rank's q heads read, replicated
                head = rank * h // (a.n_heads // kv_n)
                kv = (head * hd, (head + 1) * hd)
            p = f"layers.{i}."
            q = (rank * h * hd, (rank + 1) * h * hd)
            out[p + "attention.wq.weight"] = (0, [q])
            out[p + "attention.wk.weight"] = (0, [kv])
            if kind == SLIDING:
                out[p + "attention.wv.weight"] = (0, [kv])
            out[p + "attention.wo.weight"] = (1, [q])
            out[p + "w1.weight"] = out[p + "w3.weight"] = (0, [hidden])
            out[p + "w2.weight"] = (1, [hidden])
            gate, up = moe, (a.moe_hidden_dim + moe[0], a.moe_hidden_dim + moe[1])
            out[p + "experts_gate_up"] = (1, [gate, up])
            out[p + "experts_down"] = (2, [moe])
        return out

    def split_layers(self, rank: int, world: int, all_reduce) -> None:
        """The layers' shapes as rank `rank` of `world` holds them (`tp_cuts`), the ranks' partial
        sums added up by `all_reduce` after each attention's output projection and, for both MLPs'
        partial outputs in one call, by `reduce_ffn` before the norms that follow."""
        a, e = self.args, self.args.extra
        for layer in self.layers:
            att = layer.attention
            att.n_heads = a.n_heads // world
            att.n_kv_heads = max(1, att.n_kv_heads // world)
            for linear in (m for m in layer.modules() if isinstance(m, nn.Linear)):
                linear.out_features, linear.in_features = linear.weight.shape
            att.wo.register_forward_hook(lambda _module, _inputs, output: all_reduce(output))
            layer.reduce_ffn = all_reduce
        self.args = replace(
            a,
            n_heads=a.n_heads // world,
            n_kv_heads=max(1, a.n_kv_heads // world),
            hidden_dim=a.hidden_dim // world,
            moe_hidden_dim=a.moe_hidden_dim // world,
            extra={**e, "full_kv_heads": max(1, e["full_kv_heads"] // world)},
        )

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """One position of a layer in the pool: its K (or V) flattened to the widest layer's width
        (sliding and full layers differ in heads and head width)."""
        e, a = self.args.extra, self.args
        return (a.n_layers, 1, max(a.n_kv_heads * a.head_dim, e["full_kv_heads"] * e["full_head_dim"]))

    @property
    def embed_scale(self) -> torch.Tensor:
        """sqrt(dim) rounded to the weights' dtype (55.5 for 3072 in bfloat16), as the reference's."""
        return torch.tensor(self.args.dim**0.5, dtype=self.tok_embeddings.weight.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens) * self.embed_scale

    def soft_input(self, logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning signal of a canvas from its previous step's logits (T, V), cast to
        the weights' dtype first as the reference keeps them."""
        w = self.tok_embeddings.weight
        return (logits.to(w.dtype).softmax(-1, dtype=torch.float32).to(w.dtype) @ w) * self.embed_scale

    def self_conditioned(self, x: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
        h = self.sc_norm(signal)
        return self.sc_post_norm(x + self.sc_w2(_gelu(self.sc_w1(h)) * self.sc_w3(h)))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.tok_embeddings.weight).float()
        cap = self.args.extra["softcap"]
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- images -------------------------------------------------------------------------------
    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def image_features(self, image) -> torch.Tensor:
        """One image (`text.images.open_image` reads it) as soft tokens (n, dim) in the model's dtype."""
        if self.vision is None:
            raise ValueError(f"images: {self.name_or_path or 'this model'} holds no vision tower")
        patches, positions = patchify(open_image(image), self.vision.a)
        with torch.inference_mode():
            return self.vision(patches, positions).to(self.dtype)

    def _image_runs(self, ids: list[int], images: list) -> tuple[list, list, list[int], int]:
        """Where a prompt's pictures go: per picture its run of the prompt (from, to, placed by a
        processor already), the picture read, its soft-token count (from its size), and the
        placed prompt's length; every check made before a tower runs."""
        e = self.args.extra
        img, boi, eoi = e["image_token_id"], e["boi_token_id"], e["eoi_token_id"]
        runs, i = [], 0
        while i < len(ids):
            if ids[i] != img:
                i += 1
                continue
            if i > 0 and ids[i - 1] == boi:
                j = i
                while j < len(ids) and ids[j] == img:
                    j += 1
                if j == len(ids) or ids[j] != eoi:
                    raise ValueError("images: image tokens after a begin-of-image token must end with end-of-image")
                runs.append((i, j, True))
                i = j
            else:  # a placeholder: one per image
                runs.append((i, i + 1, False))
                i += 1
        if len(runs) != len(images):
            raise ValueError(
                f"images: {len(images)} image(s) given, but the prompt holds {len(runs)} image placeholder(s)"
            )
        if images and self.vision is None:
            raise ValueError(f"images: {self.name_or_path or 'this model'} holds no vision tower")
        opened = [open_image(image) for image in images]
        counts = [soft_token_count(image, self.vision.a) for image in opened]
        for (i, j, placed), n in zip(runs, counts):
            if placed and j - i != n:
                raise ValueError(f"images: an image of {n} soft tokens, but its run in the prompt holds {j - i}")
        length = len(ids) + sum(n + 1 for (_, _, placed), n in zip(runs, counts) if not placed)
        if length > self.args.max_seq_len:
            raise ValueError(
                f"images: the prompt with its {len(images)} picture(s) ({sum(counts)} soft tokens) holds {length} "
                f"tokens, more than the model's context ({self.args.max_seq_len})"
            )
        return runs, opened, counts, length

    def _placed(self, ids: list[int], runs: list, counts: list[int]) -> tuple[list[int], list[int]]:
        """The prompt with each placeholder run made begin-of-image, `counts[k]` image tokens and
        end-of-image (a run placed already kept), and where each picture's first soft token is."""
        e = self.args.extra
        out, firsts, last = [], [], 0
        for (i, j, placed), n in zip(runs, counts):
            out += ids[last:i] + ([] if placed else [e["boi_token_id"]])
            firsts.append(len(out))
            out += [e["image_token_id"]] * n + ([] if placed else [e["eoi_token_id"]])
            last = j
        return out + ids[last:], firsts

    def placed_ids(self, ids: list[int], images: list) -> list[int]:
        runs, _, counts, _ = self._image_runs(ids, images)
        return self._placed(ids, runs, counts)[0]

    def place_images(self, ids: list[int], images: list) -> tuple[list[int], tuple | None]:
        """A prompt's image placeholders filled, as Gemma 4's processor fills them: each image token
        (what its chat template writes per image) becomes the begin-of-image token, one image
        token per soft token and the end-of-image token; a run already that long between those
        two tokens (the processor's output) is kept. Returns the ids and (columns, soft tokens) of
        the images, in order, for `packed_logits`' `embeds`. Every picture is read and counted
        first (`_image_runs`): a prompt its pictures would push past the context is refused
        before the tower runs."""
        runs, opened, counts, _ = self._image_runs(ids, images)
        if not images:
            return list(ids), None
        out, firsts = self._placed(ids, runs, counts)
        vectors = [self.image_features(image) for image in opened]  # as many soft tokens as counted
        columns = [torch.arange(first, first + len(v)) for first, v in zip(firsts, vectors)]
        return out, (torch.cat(columns), torch.cat(vectors))

    def packed_logits(
        self,
        x: torch.Tensor,
        windows: list[tuple[int, int, int, int, int]],
        cache=None,
        *,
        compiled: bool = False,
        block_size: int | None = None,
        batch_invariant: bool = False,
        embeds: dict | None = None,
        adapters: dict | None = None,
        canvas: dict | None = None,
    ) -> list[torch.Tensor]:
        """Rows' windows in one forward, packed end to end: each window (row, lo, hi, keys, start)
        computes the columns [lo, hi) of its row of `x` ([start, hi) its canvas; the columns before
        it as the encoder computes them), writes their K/V into the row's pages of `cache` and attends
        over its keys [0, keys) there, and returns the canvas's logits. `embeds` {row: (columns,
        vectors)}: a canvas's self-conditioning signal (`soft_input`), zeros where none is given.
        Exact with any window that recomputes every column whose K/V are not an encoder's: a canvas
        is recomputed as the encoder commits it by the next block's first forward (`cache="dual"`
        with the vicinity or full refresh, `"prefix"`, `"none"`). No LoRA adapters (`adapters`)."""
        del block_size
        if adapters:
            raise ValueError("adapter: not yet for DiffusionGemma")
        if canvas:
            raise ValueError("canvas: DiffusionGemma's windows attend one way")
        if any(start >= hi for _, _, hi, _, start in windows):
            raise ValueError("windows: each must hold a canvas (start < hi)")
        # each row attends over its own keys; under BatchInvariant its linear layers and experts
        # see the same shapes whatever the batch (`models.invariance`)
        with BatchInvariant() if batch_invariant else contextlib.nullcontext():
            h, picks, offset = self._hidden(x, windows, cache, embeds, batch_invariant, compiled), [], 0
            for _, lo, hi, _, start in windows:
                picks.append(h[offset + start - lo : offset + hi - lo])
                offset += hi - lo
            out = self.head(torch.cat(picks))  # every canvas's logits in one call
        return list(out.split([hi - start for _, _, hi, _, start in windows]))

    def _hidden(self, x: torch.Tensor, windows, cache, embeds, batch_invariant=False, compiled=False) -> torch.Tensor:
        """Final-norm hidden states (N, dim) of the windows packed end to end (`packed_logits`); a
        window whose canvas starts at its end is the encoder's causal pass alone. `compiled`: each
        layer's dense math through torch.compile (`compiled_layers`)."""
        dev = x.device
        for _, lo, hi, keys, start in windows:
            if not lo <= start <= hi <= keys:
                raise ValueError(f"window {(lo, hi)} with keys {keys} does not hold a canvas from {start}")
        # every window's (row, column, in its canvas) built on the host and sent in one copy
        rows = [row for row, lo, hi, _, _ in windows for _ in range(lo, hi)]
        columns = [c for _, lo, hi, _, _ in windows for c in range(lo, hi)]
        flags = [int(c >= start) for _, lo, hi, _, start in windows for c in range(lo, hi)]
        placed = torch.tensor([rows, columns, flags], device=dev)
        positions, canvas = placed[1], placed[2].bool()
        # the canvas columns' packed places, known on the host (no boolean index: a host read on a GPU)
        in_canvas = torch.tensor([j for j, c in enumerate(flags) if c], dtype=torch.long, device=dev)
        at = torch.cat([placed[:2], placed[:2, :1]], 1)  # and a spare column (`_given_vectors`)
        h = self.embed(x[at[0], at[1]])[None]
        signal = torch.zeros(len(in_canvas) + 1, self.args.dim, dtype=self.dtype, device=dev)
        signal, images = self._given_vectors(h, signal, windows, embeds)
        h = h[:, :-1]
        h[0, in_canvas] = self.self_conditioned(h[0, in_canvas], signal[:-1])
        # every row's columns, one after another: where each layer writes their K/V in one copy
        slots = None if cache is None else cache.write_slots([(row, lo, hi) for row, lo, hi, _, _ in windows])
        plan = AttentionPlan(
            windows,
            self._key_slots(windows, cache, dev),
            self._image_groups(images, max(w[3] for w in windows)),
            self.args.extra["sliding_window"],
            dev,
            # one call on every device: on this project's CPU as fast as a call per row (measured)
            one_call(self.attention_calls, dev, len(windows), batch_invariant, cpu_too=True),
        )
        dense = self.compiled_layers() if compiled else [None] * len(self.layers)
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self._rope(positions))):
            h = layer(h, cos, sin, plan, canvas, None if cache is None else cache.layer(i), slots, dense[i])
        return self.norm(h)[0]

    def _rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the RoPE tables (cos, sin) of `positions` for its kind of layer."""
        tables = {
            SLIDING: (self.sliding_cos[positions], self.sliding_sin[positions]),
            FULL: (self.full_cos[positions], self.full_sin[positions]),
        }
        return [tables[kind] for kind in self.args.extra["layer_types"]]

    def window_logits_static(
        self, tokens, positions, columns, key_ok, key_positions, cache, block_size, keep, starts, spans, given=None
    ) -> torch.Tensor:
        """`Transformer.window_logits_static` for this model: `packed_logits`' arithmetic with
        every shape fixed, the rows (B, T) packed one after another. A column from its row's start
        (`starts`) is in its canvas: self-conditioned, by the `given` vector there (its signal,
        zeros where none), while a given vector before the canvas is an image's soft token in
        place of the column's embedding. (`block_size`, `spans`: its windows attend one way.)"""
        del block_size, spans
        bsz, t = tokens.shape
        canvas = positions >= starts[:, None]
        h, signal = self.embed(tokens), torch.zeros(bsz, t, self.args.dim, dtype=self.dtype, device=tokens.device)
        if given is not None:
            vectors, flags = given[0].to(self.dtype), given[1]
            h = torch.where((flags & ~canvas)[..., None], vectors.to(h.dtype), h)
            signal = torch.where((flags & canvas)[..., None], vectors, signal)
        h = torch.where(canvas[..., None], self.self_conditioned(h, signal), h).view(1, bsz * t, -1)
        plan = FixedPlan(positions, starts, key_ok, key_positions, columns, self.args.extra["sliding_window"])
        canvas = canvas.flatten()
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self._rope(positions.flatten()))):
            h = layer(h, cos, sin, plan, canvas, cache.layer(i))
        h = self.norm(h).view(bsz, t, -1)
        return self.head(h.gather(1, keep[..., None].expand(-1, -1, h.shape[-1])))

    def fits_fixed_form(self, seq, windows: list) -> bool:
        """Not where an image's columns may be among a window's queries while images attend each
        other both ways (`_image_groups`, which the fixed shapes do not carry): a window that
        computes columns before its canvas, of a row given input vectors. Such steps (a block's
        first, under refreshes that recompute the prompt) run eagerly."""
        if not self.args.extra.get("vision_bidirectional") or not seq.embeds:
            return True
        return not any(row in seq.embeds and lo < start for row, lo, _, _, start in windows)

    def _given_vectors(self, h: torch.Tensor, signal: torch.Tensor, windows, embeds) -> tuple[torch.Tensor, list]:
        """The rows' input vectors (`embeds`: {row: (columns, vectors)}) put in place, every row's at
        once: an image's soft tokens in the prompt replace the scaled embeddings of their columns in
        `h` (1, N + 1, dim) where a window computes them; in the canvas they are its
        self-conditioning `signal` (canvas columns + 1, dim). A vector that belongs to neither goes
        to each one's spare last row (no boolean index: a host read on a GPU). Returns the signal
        and, where pictures attend both ways, each window's image columns (`_image_groups`)."""
        dev, given = h.device, [(j, embeds[row]) for j, (row, *_) in enumerate(windows) if embeds and row in embeds]
        if not given:
            return signal, [torch.zeros(0, dtype=torch.long, device=dev)] * len(windows)
        offsets = [0, *itertools.accumulate(hi - lo for _, lo, hi, _, _ in windows)]
        canvas_offsets = [0, *itertools.accumulate(hi - start for _, _, hi, _, start in windows)]
        # per given vector: its window's lo, start, offset in `h` and in `signal`
        per = [
            (windows[j][1], windows[j][4], offsets[j], canvas_offsets[j]) for j, (w, _) in given for _ in range(len(w))
        ]
        lo, start, offset, canvas_offset = torch.tensor(per, device=dev).view(-1, 4).unbind(1)
        where = torch.cat([w.to(dev) for _, (w, _) in given])
        vectors = torch.cat([v.to(dev, self.dtype) for _, (_, v) in given])
        before = where < start  # an image's soft tokens in the prompt; in the canvas, the signal
        signal[torch.where(before, signal.shape[0] - 1, canvas_offset + where - start)] = vectors
        inside = before & (where >= lo)  # a prompt column this window computes
        h[0, torch.where(inside, offset + where - lo, h.shape[1] - 1)] = vectors.to(h.dtype)
        images = [torch.zeros(0, dtype=torch.long, device=dev)] * len(windows)
        if self.args.extra.get("vision_bidirectional"):  # each window's image columns
            for j, (w, _) in given:
                w = w.to(dev)
                images[j] = w[w < windows[j][4]]
        return signal, images

    def compiled_layers(self) -> list:
        """Per layer, its dense math before attention, between attention and the experts, and after
        them, through torch.compile (the experts' grouped matmul and the attention run eagerly)."""
        if self._compiled_layers is None:
            self._compiled_layers = [
                tuple(
                    torch.compile(f, dynamic=True)
                    for f in (layer.before_attention, layer.after_attention, layer.after_experts)
                )
                for layer in self.layers
            ]
        return self._compiled_layers

    @staticmethod
    def _key_slots(windows, cache, device) -> tuple[torch.Tensor, list[int]]:
        """Where each window's keys [0, keys) are, as a padded table (windows, most keys) and the
        counts: its row's pool slots, or without a pool its window's own packed positions (a window
        from column 0 whose keys are its columns)."""
        if cache is not None:
            return cache.key_slots([(row, keys) for row, _, _, keys, _ in windows])
        table, offset, most = [], 0, max(keys for *_, keys, _ in windows)
        for _, lo, hi, keys, _ in windows:
            if lo != 0 or keys != hi:
                raise ValueError(f"window {(lo, hi)} with keys {keys}: without a cache a window attends to itself")
            table.append(list(range(offset, offset + keys)) + [0] * (most - keys))
            offset += hi - lo
        return torch.tensor(table, device=device), [keys for *_, keys, _ in windows]

    def _image_groups(self, columns: list[torch.Tensor], keys: int) -> torch.Tensor | None:
        """Per window's row, each of its columns [0, keys): the index of the image it belongs to (a
        run of consecutive soft-token `columns`), -1 for text; None where images attend causally (a
        config without `use_bidirectional_attention="vision"`) or no row has one."""
        if not self.args.extra.get("vision_bidirectional") or not any(len(c) for c in columns):
            return None
        groups = torch.full((len(columns), keys), -1, dtype=torch.long, device=columns[0].device)
        for r, cols in enumerate(columns):
            if len(cols):
                cols = cols.sort().values
                starts = torch.ones_like(cols, dtype=torch.bool)
                starts[1:] = cols[1:] != cols[:-1] + 1
                inside = cols < keys
                groups[r, cols[inside]] = (starts.long().cumsum(0) - 1)[inside]
        return groups

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, batch_invariant: bool = False
    ) -> torch.Tensor:
        """The encoder's causal pass: logits (B, L, V) of each whole sequence (no padding)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask: DiffusionGemma's forward takes unpadded sequences")
        bsz, n = input_ids.shape
        h = self._hidden(input_ids, [(i, 0, n, n, n) for i in range(bsz)], None, None, batch_invariant)
        return self.head(h).view(bsz, n, -1)


# ---- the checkpoint: transformers' config.json and weight names ------------------------------------


def _text(cfg: dict) -> dict:
    """The fields our args read: the text config's, with the canvas length beside them."""
    text = dict(cfg.get("text_config") or {})
    text["canvas_length"] = cfg.get("canvas_length", 256)
    text["vision_config"] = cfg.get("vision_config")
    for name, default in (("image_token_id", 258_880), ("boi_token_id", 255_999), ("eoi_token_id", 258_882)):
        text[name] = cfg.get(name, default)
    return text


def _check(cfg: dict, where: str) -> None:
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError(
            f"{where}: field use_bidirectional_attention='all' is not supported (its encoder must be causal)"
        )
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: field hidden_activation={cfg['hidden_activation']!r} is not supported")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: field attention_bias=True is not supported")
    if not cfg.get("num_experts"):
        raise ValueError(f"{where}: a DiffusionGemma config without experts (num_experts) is not supported")


def _adjust(cfg: dict, values: dict) -> None:
    n = values["n_layers"]
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    types[-1] = FULL  # as its config class forces
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    first_full = types.index(FULL)
    full = per_layer.get(first_full, {})
    rope = cfg.get("rope_parameters") or {}
    full_rope = rope.get(FULL) or {"rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25}
    sliding_rope = rope.get(SLIDING) or {"rope_theta": 10_000.0}
    values["rope_theta"] = float(sliding_rope.get("rope_theta", 10_000.0))
    values["extra"] = {
        "layer_types": types,
        "sliding_window": int(cfg.get("sliding_window", 512)),
        "full_head_dim": int(full.get("head_dim", cfg.get("global_head_dim", 512))),
        "full_kv_heads": int(
            full.get("num_key_value_heads", cfg.get("num_global_key_value_heads") or values["n_kv_heads"])
        ),
        "full_rope_theta": float(full_rope.get("rope_theta", 1_000_000.0)),
        "full_rotary": float(full_rope.get("partial_rotary_factor", 1.0))
        if full_rope.get("rope_type") == "proportional"
        else None,
        "softcap": cfg.get("final_logit_softcapping", 30.0),
        "canvas_length": int(cfg["canvas_length"]),
        # Gemma 4's vision tower (`gemma_vision`), and where its soft tokens go in a prompt; an
        # image's tokens see each other both ways where the text config says "vision"
        "vision": cfg.get("vision_config"),
        "vision_bidirectional": cfg.get("use_bidirectional_attention") == "vision",
        "image_token_id": int(cfg["image_token_id"]),
        "boi_token_id": int(cfg["boi_token_id"]),
        "eoi_token_id": int(cfg["eoi_token_id"]),
    }
    # no mask token: the loop's placeholder for positions of blocks not yet opened (never in a
    # forward: a canvas is drawn when its block opens) is the pad token
    values["mask_token_id"] = int(cfg.get("pad_token_id") or 0)


class GemmaFamily(Family):
    """A family whose layers differ from one another (sliding layers have a value projection, full
    layers none) and whose experts are stacked in the checkpoint as they are here."""

    def experts_one_by_one(self, theirs: str, args: ModelArgs) -> list[tuple[str, ...]] | None:
        """llm-compressor's form of the experts (transformers' fused `experts.gate_up_proj` and
        `experts.down_proj` unfused into each expert's linear layers, which it quantizes):
        `experts.{e}.gate_proj` and `.up_proj` joined, and `experts.{e}.down_proj`."""
        layer, _, kind = theirs.rpartition(".experts.")
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(kind)
        if parts is None:
            return None
        return [tuple(f"{layer}.experts.{e}.{p}.weight" for p in parts) for e in range(args.n_experts)]

    def weight_names(self, args: ModelArgs) -> dict[str, str]:
        names = dict(self.weights.top)
        for i, kind in enumerate(args.extra["layer_types"]):
            for ours, theirs in self.weights.layer.items():
                if kind == FULL and ours.endswith("attention.wv.weight"):
                    continue
                names[ours.format(i=i)] = theirs.format(i=i)
        if args.extra.get("vision"):
            names.update(vision_weight_names(VisionArgs.of(args.extra["vision"], args.dim), "vision"))
        return names

    def fit_to_checkpoint(self, model, present: set[str]) -> None:
        """A checkpoint saved without its vision tower (a text-only conversion) loads as text
        alone: images are then refused by name."""
        if model.vision is not None and "model.encoder.embed_vision.embedding_projection.weight" not in present:
            model.vision = None
            model.args = replace(model.args, extra={**model.args.extra, "vision": None})


LAYER = "model.decoder.layers.{i}"
FAMILY = GemmaFamily(
    name="DiffusionGemma",
    model_type=MODEL_TYPE,
    shifted_logits=False,
    reference_config={"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": MODEL_TYPE},
    required=("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"),
    source=_text,
    fields={
        "dim": ConfigField(("hidden_size",)),
        "n_layers": ConfigField(("num_hidden_layers",)),
        "n_heads": ConfigField(("num_attention_heads",)),
        "n_kv_heads": ConfigField(("num_key_value_heads",), default=lambda v: v["n_heads"]),
        "head_size": ConfigField(("head_dim",), default=256),
        "hidden_dim": ConfigField(("intermediate_size",)),
        "vocab_size": ConfigField(("vocab_size",)),
        "max_seq_len": ConfigField(("max_position_embeddings",), default=131_072),
        "norm_eps": ConfigField(("rms_norm_eps",), float, 1e-6),
        "eos_token_id": ConfigField(("eos_token_id",), default=1),
        "n_experts": ConfigField(("num_experts",)),
        "n_active_experts": ConfigField(("top_k_experts",)),
        "moe_hidden_dim": ConfigField(("moe_intermediate_size",)),
    },
    check=_check,
    adjust=_adjust,
    fixed={"tie_embeddings": True},
    weights=WeightNames(
        top={
            "tok_embeddings.weight": "model.decoder.embed_tokens.weight",
            "norm.weight": "model.decoder.norm.weight",
            "sc_norm.weight": "model.decoder.self_conditioning.pre_norm.weight",
            "sc_w1.weight": "model.decoder.self_conditioning.gate_proj.weight",
            "sc_w3.weight": "model.decoder.self_conditioning.up_proj.weight",
            "sc_w2.weight": "model.decoder.self_conditioning.down_proj.weight",
        },
        layer={
            "layers.{i}.attention_norm.weight": f"{LAYER}.input_layernorm.weight",
            "layers.{i}.attention.wq.weight": f"{LAYER}.self_attn.q_proj.weight",
            "layers.{i}.attention.wk.weight": f"{LAYER}.self_attn.k_proj.weight",
            "layers.{i}.attention.wv.weight": f"{LAYER}.self_attn.v_proj.weight",
            "layers.{i}.attention.wo.weight": f"{LAYER}.self_attn.o_proj.weight",
            "layers.{i}.attention.q_norm.weight": f"{LAYER}.self_attn.q_norm.weight",
            "layers.{i}.attention.k_norm.weight": f"{LAYER}.self_attn.k_norm.weight",
            "layers.{i}.post_attention_norm.weight": f"{LAYER}.post_attention_layernorm.weight",
            "layers.{i}.ffn_norm.weight": f"{LAYER}.pre_feedforward_layernorm.weight",
            "layers.{i}.w1.weight": f"{LAYER}.mlp.gate_proj.weight",
            "layers.{i}.w3.weight": f"{LAYER}.mlp.up_proj.weight",
            "layers.{i}.w2.weight": f"{LAYER}.mlp.down_proj.weight",
            "layers.{i}.post_ffn_norm_1.weight": f"{LAYER}.post_feedforward_layernorm_1.weight",
            "layers.{i}.router_scale": f"{LAYER}.router.scale",
            "layers.{i}.router.weight": f"{LAYER}.router.proj.weight",
            "layers.{i}.per_expert_scale": f"{LAYER}.router.per_expert_scale",
            "layers.{i}.experts_gate_up": f"{LAYER}.experts.gate_up_proj",
            "layers.{i}.experts_down": f"{LAYER}.experts.down_proj",
            "layers.{i}.experts_norm.weight": f"{LAYER}.pre_feedforward_layernorm_2.weight",
            "layers.{i}.post_ffn_norm_2.weight": f"{LAYER}.post_feedforward_layernorm_2.weight",
            "layers.{i}.post_ffn_norm.weight": f"{LAYER}.post_feedforward_layernorm.weight",
            "layers.{i}.decoder_scalar": f"{LAYER}.layer_scalar",
            "layers.{i}.encoder_scalar": "model.encoder.language_model.layers.{i}.layer_scalar",
        },
    ),
    model_class=DiffusionGemma,
    rules=DecodingRules(published="diffusion_gemma", noise_canvas=True),
)
