"""The shared transformer behind every model family (gpt-fast style).

Every family is Llama-shaped: pre-norm RMSNorm blocks, rotary position embeddings, multi-head
(optionally grouped-query) attention and a SwiGLU MLP; Qwen3-based ones (SDAR) add a per-head
RMSNorm of q and k before RoPE; LLaDA2's (BailingMoeV2) fuse q/k/v into one projection, rotate
only the first part of each head (partial rotary) and replace the MLP of all but the first layers
by a mixture of experts (`moe.MoEFeedForward`). Attention is bidirectional over the whole sequence
(LLaDA, Dream, LLaDA-MoE) or *block-causal* (`block_size` > 0: SDAR, Fast-dLLM v2, LLaDA2): the
position at RoPE index p belongs to block p // block_size and attends to every key of its own
block and of earlier blocks, none after. The family files only translate their checkpoint's
config fields and weight names into `ModelArgs` and the module names used here, and say whether
the logits are shifted.

The one forward that decoding needs is `Transformer.packed_logits`: every row's window of the
layout in one packed sequence, each attending over its own keys in its pages of the K/V pool
(`engine.kv`); `window_logits_static` is its fixed-shape form (CUDA graphs). `logits_for` is a
full forward's logits of a span (scoring and tools).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .invariance import BatchInvariant
from .mlp import FeedForward
from .moe import MoEFeedForward
from .packed import PackedRows, one_call


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as both reference implementations do, then scale in the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_len, head_dim) in fp32, half-split layout (rotate_half)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    return rope_tables_of(inv_freq, max_len, device)


def rope_tables_of(inv_freq: torch.Tensor, max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_len, 2 * len(inv_freq)) in fp32 of given inverse frequencies."""
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (B or 1, 1, T, R) in fp32 (LLaDA's rope_full_precision). With R < D
    # (partial rotary) the first R dims rotate and the rest pass through.
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def soft_embeddings(embedding, top_token: torch.Tensor, top_prob: torch.Tensor, mask_id: int) -> torch.Tensor:
    """DMax's soft input for a revealed position: p E[top] + (1 - p) E[mask], p the probability of
    the position's most probable token, rescaled to the norm p |E[top]| + (1 - p) |E[mask]| (so
    that it stays on the embeddings' sphere), in float32; (B, T, D) for `top_*` (B, T)."""
    p = top_prob.float().unsqueeze(-1)
    rest = (1 - p).clamp_min(0)
    top = embedding(top_token).float()
    mask = embedding(torch.tensor([mask_id], device=top_token.device))[0].float()
    mixed = p * top + rest * mask
    target = p * top.norm(dim=-1, keepdim=True) + rest * mask.norm()
    return mixed * (target / (mixed.norm(dim=-1, keepdim=True) + 1e-6))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        if args.fused_qkv:
            self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
            self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
            self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def project(self, x, cos, sin, q_scale=None):
        """q, k, v (B, heads, T, head_dim) of a window, RoPE applied; then q times `q_scale` (B, 1,
        T, 1) where the model scales its queries by position (`Transformer.q_scale`)."""
        bsz, seqlen, _ = x.shape
        if hasattr(self, "wqkv"):  # heads in the order q..., k..., v...
            q, k, v = (
                self.wqkv(x)
                .view(bsz, seqlen, -1, self.head_dim)
                .split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
            )
        else:
            q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
            k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
            v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(q, cos, sin)
        return q if q_scale is None else q * q_scale.to(q.dtype), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, key_mask, layer_cache, window_start: int, spans=None) -> torch.Tensor:
        """Attention over the window's K/V, or over the whole cached sequence with this window's
        K/V written into the cache; (B, T, heads * head_dim), before the output projection.

        `spans` (per row, the columns [lo, hi) holding its keys; `key_spans`): each row attends
        over its own keys alone, as it would unbatched. Padding otherwise changes how attention's
        sums are split and rounded (~1e-2 in bfloat16), which is what flips a near-tied token."""
        if layer_cache is not None:
            k, v = layer_cache.update(window_start, k, v)
        gqa = self.n_kv_heads != self.n_heads
        if spans is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=gqa)
        else:
            # the row's queries too: the window's columns inside its span (the rest is padding)
            out = q.new_zeros(q.shape)
            for i, (lo, hi) in enumerate(spans):
                q_lo, q_hi = max(lo - window_start, 0), min(hi - window_start, q.shape[2])
                mask = None
                if key_mask is not None:
                    queries = slice(q_lo, q_hi) if key_mask.shape[2] > 1 else slice(None)  # else one row for all
                    mask = key_mask[i : i + 1, :, queries, lo:hi]
                    mask = None if bool(mask.all()) else mask
                out[i : i + 1, :, q_lo:q_hi] = F.scaled_dot_product_attention(
                    q[i : i + 1, :, q_lo:q_hi],
                    k[i : i + 1, :, lo:hi],
                    v[i : i + 1, :, lo:hi],
                    attn_mask=mask,
                    enable_gqa=gqa,
                )
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def forward(self, x, cos, sin, key_mask, layer_cache, window_start: int) -> torch.Tensor:
        return self.wo(self.attend(*self.project(x, cos, sin), key_mask, layer_cache, window_start))

    def attend_segments(self, q, k, v, segments, layer_cache, slots, packed=None) -> torch.Tensor:
        """Attention of packed rows (`Segment`s of the one sequence (1, heads, N, head_dim)): every
        row's window K/V written into its own pages of the cache (`PagedKVCache`) in one copy, at
        `slots` (`PagedKVCache.write_slots`), then every row's queries attending over its own keys:
        in one call (`packed`: (`packed.PackedRows`, its mask)), or a call per row over views of the
        cache where its keys are one run (no padding, no copy). (1, N, heads * head_dim)."""
        gqa = self.n_kv_heads != self.n_heads
        layer_cache.write(slots, k, v)
        if packed is not None:
            rows, mask = packed
            keys, values = (t.transpose(0, 1)[rows.keys] for t in (layer_cache.k, layer_cache.v))
            return rows.attend(q[0].transpose(0, 1), keys, values, mask, gqa=gqa).reshape(1, q.shape[2], -1)
        out = q.new_empty(q.shape)
        for s in segments:
            keys, values = layer_cache.keys(s.row, s.keys)
            out[:, :, s.offset : s.offset + s.width] = F.scaled_dot_product_attention(
                q[:, :, s.offset : s.offset + s.width], keys, values, attn_mask=s.mask, enable_gqa=gqa
            )
        return out.transpose(1, 2).reshape(1, q.shape[2], -1)


class Segment:
    """One row's part of a packed forward: its query columns [lo, hi) (their K/V written into its
    cache row), at `offset` in the packed sequence, attending to its keys [0, keys) with `mask`
    ((width, keys) bool, block-causal attention) or none."""

    __slots__ = ("row", "lo", "hi", "keys", "offset", "mask")

    def __init__(self, row: int, lo: int, hi: int, keys: int, offset: int, mask=None):
        self.row, self.lo, self.hi, self.keys, self.offset, self.mask = row, lo, hi, keys, offset, mask

    @property
    def width(self) -> int:
        return self.hi - self.lo


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(index):
            self.feed_forward = MoEFeedForward(args)
        else:
            self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin, key_mask, layer_cache, window_start, dense=None, spans=None, q_scale=None):
        """`dense`: (before, after), compiled versions of `before_attention` / `after_attention`;
        `spans`: each row's key columns (`Attention.attend`)."""
        before, after = dense or (self.before_attention, self.after_attention)
        q, k, v = before(x, cos, sin, q_scale)
        return after(x, self.attention.attend(q, k, v, key_mask, layer_cache, window_start, spans))

    def forward_segments(self, x, cos, sin, segments, layer_cache, slots, dense=None, q_scale=None, packed=None):
        before, after = dense or (self.before_attention, self.after_attention)
        q, k, v = before(x, cos, sin, q_scale)
        return after(x, self.attention.attend_segments(q, k, v, segments, layer_cache, slots, packed))

    # The dense math on either side of attention (what `torch.compile` fuses); the attention itself,
    # which writes the cache in place, stays eager.
    def before_attention(self, x, cos, sin, q_scale=None):
        return self.attention.project(self.attention_norm(x), cos, sin, q_scale)

    def after_attention(self, x, attended):
        x = x + self.attention.wo(attended)
        return x + self.feed_forward(self.ffn_norm(x))


def key_spans(key_mask: torch.Tensor | None, batch: int, keys: int) -> list[tuple[int, int]]:
    """Per row, the columns [lo, hi) of the keys any query may attend (its prompt to the end of
    what it sees; padding on either side left out)."""
    if key_mask is None:
        return [(0, keys)] * batch
    seen = key_mask.flatten(1, -2).any(1)  # (B, S)
    lo = seen.int().argmax(-1)
    hi = seen.shape[-1] - seen.flip(-1).int().argmax(-1)
    return list(zip(lo.tolist(), hi.tolist()))


def block_causal_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, block_size: int, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """(B, 1, T, S) True where a query (RoPE position, (B, T)) may attend a key ((B, S)): the key's
    block is not after the query's; and-ed with `key_mask` (B, 1, 1, S) (padding)."""
    allowed = (key_positions // block_size)[:, None, None, :] <= (query_positions // block_size)[:, None, :, None]
    return allowed if key_mask is None else allowed & key_mask


def placed_vectors(embeds: dict | None, places: dict, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows' input vectors (`embeds`: {row: (columns, vectors)}) at their places in a sequence of
    `n` positions (`places`: {row: (offset, lo, hi)}, its window's columns [lo, hi) laid from
    `offset`): vectors (n, dim) and flags (n,) of the positions that take one, every row's placed
    in one write; a vector of a column no window computes goes to a spare last slot, dropped (no
    boolean index: a host read on a GPU). None where no row with vectors has a window."""
    given = [(places[row], cols, v) for row, (cols, v) in (embeds or {}).items() if row in places]
    if not given:
        return None
    where = torch.cat([torch.where((c >= lo) & (c < hi), offset + c - lo, n) for (offset, lo, hi), c, _ in given])
    vectors = torch.cat([v for *_, v in given])
    placed = vectors.new_zeros(n + 1, vectors.shape[-1])
    flags = torch.zeros(n + 1, dtype=torch.bool, device=vectors.device)
    placed[where] = vectors
    flags[where] = True
    return placed[:-1], flags[:-1]


def with_given(x: torch.Tensor, given: tuple | None) -> torch.Tensor:
    """Token embeddings `x` (..., n, dim) with the flagged positions' input vectors in their place
    (`placed_vectors`, shaped as `x`'s positions)."""
    return x if given is None else torch.where(given[1][..., None], given[0].to(x.dtype), x)


def positions_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """Absolute RoPE positions (B, L). With left padding a row's first real token is position 0,
    so a padded row sees exactly the positions it would see alone."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


class Transformer(nn.Module):
    """A bidirectional Llama-shaped transformer; the families differ only in names and config
    fields (`models/family.py`).

    Besides its weights a model knows its `family` (a `models.family.Family`: one of `models.FAMILIES`),
    the `config` its checkpoint was read from (or the fields a saved one should keep), its
    `generation_config` (generation_config.json, where there is one), where it came from
    (`name_or_path`), and its `stop_token_ids` (EOS and end of turn, from the tokenizer: tokens
    after which nothing matters).

    `compiled=True` in `packed_logits` runs each layer's dense math (norms, projections,
    RoPE, the MLP) through `torch.compile` (inductor, dynamic shapes: any window width, batch size
    and cache length); attention, which writes the cache in place, stays eager, so the cache's
    views and masks cause no recompilation. The first calls compile (seconds on a CPU; `generate.
    warm_up`). In float32 the tokens are the eager ones (tested); in bfloat16 fused kernels round
    differently, which can flip a near-tied token."""

    def __init__(
        self,
        args: ModelArgs,
        family=None,
        config: dict | None = None,
        name_or_path: str | None = None,
        stop_token_ids: list[int] | None = None,
    ):
        super().__init__()
        self.args = args
        self.family = family
        self.config: dict = dict(config or {})
        self.name_or_path = name_or_path
        # The checkpoint's generation_config.json, where it has one (Dream's).
        self.generation_config: dict = {}
        # Weight-only quantization of the linear layers (`quant.describe`: bits, group size,
        # kernels, checkpoint format), None when the weights are in the model's dtype.
        self.quantization: dict | None = None
        # Why the weights are not in the checkpoint's dtype (`loading.auto_dtype`), None if they are.
        self.dtype_note: str | None = None
        # Embedding's own init, except on the meta device (a checkpoint's weights follow), where its
        # normal_ would import torch._dynamo: seconds of every command's start
        embeddings = torch.empty(args.vocab_size, args.dim)
        if not embeddings.is_meta:
            nn.init.normal_(embeddings)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=embeddings)
        self.layers = self.make_layers(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.make_extra(args)
        self.setup_rope()
        self.stop_token_ids: list[int] = list(stop_token_ids) if stop_token_ids else [args.eos_token_id]
        # The token that ends a thinking span (its tokenizer's </think>), where it has one: what a
        # thinking budget places (`GenerationConfig.max_thinking_tokens`).
        self.end_think_token_id: int | None = None
        # The preset it decodes with unless told otherwise: its family's own decoder, or the one a
        # checkpoint's name says it was trained for (`loading.recognized_decoding`).
        self.decoding: str | None = None if family is None else family.rules.published
        self._compiled_layers: list | None = None  # built on first use (not modules: no second state_dict)
        self._graphed_window = None  # `graphed_window_logits`, compiled on first use
        self.lora = None  # named LoRA adapters beside the weights (`models.lora.LoRAAdapters`)

    @property
    def causal_prompt(self) -> bool:
        """Whether a prompt's K/V depend on nothing after them (a block-causal model's prompt blocks,
        a causal pass's prompt), so that a prefix's K/V are exact to share and to compute in chunks."""
        return bool(self.args.block_size)

    @property
    def mixes_block_lengths(self) -> bool:
        """Whether rows decoding in blocks of different lengths may share its forwards: where the
        decoding block shapes no attention mask (bidirectional attention), or shapes only each
        row's own window (Nemotron-Labs-Diffusion). A block-causal model's prompt K/V depend on
        the block, and rows that share them must agree on it."""
        return not self.args.block_size

    @property
    def captures_steps(self) -> bool:
        """Whether its steps take the fixed shapes a CUDA graph replays (`window_logits_static`,
        `cuda_graphs`): not where masks attend last (WeDLM), whose order follows the tokens."""
        return not self.args.masks_last

    def fits_fixed_form(self, seq, windows: list) -> bool:
        """Whether a step of these windows may take the fixed-shape step (`kv.runner.FixedForm`);
        a model with a rule of its own that the fixed shapes do not carry says no. (Rows of other
        block lengths share a step only where its masks read none: `mixes_block_lengths`.)"""
        return True

    # Whether a decoder may choose how a window attends (`packed_logits`'s `canvas`): a model whose
    # weights run both causally and bidirectionally (Nemotron-Labs-Diffusion).
    two_passes = False

    # Whether a prompt may hold images (`place_images`): a model with a vision tower.
    takes_images = False
    # How a packed forward's rows attend: "auto" (the device's rule, `packed.one_call`), "one"
    # call per layer for every row, or a call "per_row".
    attention_calls = "auto"

    def place_images(self, ids: list[int], images: list) -> tuple[list[int], tuple | None]:
        """A prompt's image placeholders filled with the images' soft tokens: (ids, (columns,
        vectors) for `packed_logits`' `embeds`)."""
        if images:
            raise ValueError(f"images: {self.name_or_path or 'this model'} takes no images (a text model)")
        return list(ids), None

    def placed_ids(self, ids: list[int], images: list) -> list[int]:
        """The prompt's ids once `place_images` places its images (counted without running a vision
        tower)."""
        return self.place_images(ids, images)[0]

    def make_layers(self, args: ModelArgs) -> nn.ModuleList:
        """The layers (a family whose layers are not Llama-shaped builds its own: `Family.model_class`)."""
        return nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))

    def make_extra(self, args: ModelArgs) -> None:
        """Modules beside the layers that a family's model adds."""

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """One position's K/V in a layer of the pool: (layers, kv heads, head width)."""
        return (self.args.n_layers, self.args.n_kv_heads, self.args.head_dim)

    def setup_rope(self, device=None) -> None:
        if device is None:
            device = self.tok_embeddings.weight.device
            if device.type == "meta":
                device = torch.device("cpu")
        cos, sin = rope_tables(self.args.rotary_dim, self.args.max_seq_len, self.args.rope_theta, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Per position (B, 1, T, 1), what the queries are multiplied by after RoPE (Llama 4's and
        Ministral 3's long-context scale); None: by nothing."""
        return None

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    # ---- forward passes -------------------------------------------------------------------
    def compiled_layers(self) -> list:
        """Per layer, the dense math before and after attention through torch.compile."""
        if self._compiled_layers is None:
            self._compiled_layers = [
                (
                    torch.compile(layer.before_attention, dynamic=True),
                    torch.compile(layer.after_attention, dynamic=True),
                )
                for layer in self.layers
            ]
        return self._compiled_layers

    def hidden(
        self,
        tokens,
        positions,
        key_mask=None,
        cache=None,
        window_start: int = 0,
        compiled: bool = False,
        batch_invariant: bool = False,
        given: tuple | None = None,
    ):
        """Final-norm hidden states of a window of tokens (B, T) at absolute `positions` (B, T).

        `key_mask` (B, 1, 1, S) is True where a key may be attended; S is T without a cache or the
        cache length with one. With a cache, the window's K/V are written at [window_start, +T).
        `given` (vectors (B, T, dim), flags (B, T): `placed_vectors`): input vectors that replace
        the flagged columns' token embeddings (DMax's soft embeddings in a fixed-shape step).
        """
        x = with_given(self.tok_embeddings(tokens), given)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        dense = self.compiled_layers() if compiled else [None] * len(self.layers)
        spans = None
        if batch_invariant:  # each row attends alone (`invariance`); under BatchInvariant, see logits_for
            keys = tokens.shape[1] if cache is None else cache.length
            spans = key_spans(key_mask, tokens.shape[0], keys)
        qs = self.query_scale(positions)
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layer(i)
            x = layer(x, cos, sin, key_mask, layer_cache, window_start, dense[i], spans, qs)
        return self.norm(x)

    def packed_logits(
        self,
        x: torch.Tensor,
        windows: list[tuple[int, int, int, int, int]],
        cache,
        *,
        compiled: bool = False,
        block_size: int | dict[int, int] | None = None,
        batch_invariant: bool = False,
        embeds: dict | None = None,
        adapters: dict | None = None,
        canvas: dict | None = None,
    ) -> list[torch.Tensor]:
        """Rows' windows in one forward, packed end to end (no padding): `windows` are per row
        (row, lo, hi, keys, start): compute the columns [lo, hi) of row `row` of the layout `x`
        (B, L), write their K/V into its cache row, attend over its keys [0, keys) (the window's own
        and what the cache holds), and return the logits of [start, hi) (in which entry j
        predicts token start + j; a shifted family reads them one column earlier, which the
        window must cover, or open at `start`: then that column's logit is its own output). A
        column's RoPE position is its index: every row starts at column 0.
        A block-causal model's queries see the keys of their block and the blocks before it, in
        blocks of `block_size` (default its own; {row: size} where rows' differ). `embeds` {row:
        (columns, vectors)}: input vectors that replace those columns' token embeddings (DMax's
        soft embeddings), where a window of that row computes them. `adapters` {row: index}: the
        LoRA adapter each row's tokens decode with (`self.lora`; other rows: the base). `canvas`
        {row: length}: how those rows' windows attend this forward (`window_mask`'s `span`).
        Returns one (hi - start, V) tensor per window."""
        canvas = canvas or {}
        shift = 1 if self.args.shifted_logits else 0
        sizes = block_size if isinstance(block_size, dict) else {}
        bs = None if sizes else block_size or self.args.block_size
        tokens, positions, segments, offset = [], [], [], 0
        for row, lo, hi, keys, start in windows:
            # A shifted window that opens at its first logit's column has no column before it:
            # that column's logit is its own output, as position 0's always is (`logits_for`), and
            # as d3LLM's Dream code reads a cached forward's first column (`DelayedCache`).
            first = start == lo and shift
            if not (0 <= lo <= start - shift + first and start < hi <= x.shape[1] and keys <= x.shape[1]):
                raise ValueError(f"window {(lo, hi)} with keys {keys} does not cover logits for [{start}, {hi})")
            cols = torch.arange(lo, hi, device=x.device)
            mask = self.window_mask(x, row, lo, hi, keys, start, sizes.get(row, bs), canvas.get(row))
            segments.append(Segment(row, lo, hi, keys, offset, mask))
            tokens.append(x[row, lo:hi])
            positions.append(cols)
            offset += hi - lo
        tokens, positions = torch.cat(tokens)[None], torch.cat(positions)[None]
        runs = [(adapters.get(s.row, -1), s.width) for s in segments] if adapters else None
        with BatchInvariant() if batch_invariant else contextlib.nullcontext(), self.adapted(runs):
            places = {s.row: (s.offset, s.lo, s.hi) for s in segments}
            h = with_given(self.tok_embeddings(tokens), placed_vectors(embeds, places, tokens.shape[1]))
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
            dense = self.compiled_layers() if compiled else [None] * len(self.layers)
            slots = cache.write_slots([(s.row, s.lo, s.hi) for s in segments])  # the same in every layer
            packed = self.packed_rows(segments, cache, batch_invariant)
            qs = self.query_scale(positions)
            for i, layer in enumerate(self.layers):
                h = layer.forward_segments(h, cos, sin, segments, cache.layer(i), slots, dense[i], qs, packed)
            h = self.norm(h)[0]
            picks = [
                h[s.offset : s.offset + s.width][self.logit_columns(s.lo, s.hi, start, canvas.get(s.row))]
                for s, (*_, start) in zip(segments, windows)
            ]
            # the head sees the picked columns only: their adapters, in that order
            picked = [(adapters.get(row, -1), hi - start) for row, _, hi, _, start in windows] if adapters else None
            with self.adapted(picked):
                out = self.head(torch.cat(picks))
        return list(out.split([hi - start for _, _, hi, _, start in windows]))

    def packed_rows(self, segments: list, cache, batch_invariant: bool) -> tuple | None:
        """The rows' one attention call per layer, where it is made (`packed.one_call`; on a CPU a
        call per row over views of the pool was measured faster for these shapes): their index
        tables and mask, built once for every layer (`Attention.attend_segments`); else None."""
        dev = self.tok_embeddings.weight.device
        if not one_call(self.attention_calls, dev, len(segments), batch_invariant, cpu_too=False):
            return None
        rows = PackedRows([s.width for s in segments], *cache.key_slots([(s.row, s.keys) for s in segments]), dev)
        allowed = torch.zeros(rows.seen.shape, dtype=torch.bool, device=dev)
        for r, s in enumerate(segments):
            allowed[r, : s.width, : s.keys] = True if s.mask is None else s.mask
        return rows, rows.mask(allowed)

    def window_mask(self, x, row: int, lo: int, hi: int, keys: int, start: int, block_size: int, span=None):
        """(hi - lo, keys) bool: which of row `row`'s keys [0, keys) each query column [lo, hi) of a
        window attends (the logits read from `start`); None where every query sees every key. A
        block-causal model's queries see their block and the blocks before it (blocks of
        `block_size`), WeDLM's masks come after every token. `span`: a decoder's choice of how the
        window attends (`Decoder.canvas`), for a model that has more than one way."""
        if span is not None:
            raise ValueError("canvas: this model attends one way (a decoder that chooses needs another model)")
        if self.args.masks_last:
            order = self.attention_order(x[row, : max(keys, hi)], torch.arange(max(keys, hi), device=x.device))
            return order[None, :keys] <= order[lo:hi, None]
        if self.args.block_size and lo // block_size < (keys - 1) // block_size:  # else all see all
            cols = torch.arange(lo, hi, device=x.device)
            return (torch.arange(keys, device=x.device) // block_size)[None, :] <= (cols // block_size)[:, None]
        return None

    def logit_columns(self, lo: int, hi: int, start: int, span=None) -> torch.Tensor | slice:
        """Which of a window's columns (0 = its column `lo`) give the logits of positions
        [start, hi): the positions' own, or with shifted logits the column before each; a shifted
        window that opens at `start` has no column before it, and its first logit is that column's
        own output."""
        shift = 1 if self.args.shifted_logits else 0
        if start == lo and shift:
            return torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(hi - shift - lo)])
        return slice(start - shift - lo, hi - shift - lo)

    def attention_order(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where each token comes in causal attention's order: its position, or with `masks_last`
        after every token for a [MASK] (positions kept among masks), as WeDLM reorders them."""
        if not self.args.masks_last:
            return positions
        return positions + (tokens == self.mask_token_id) * (1 << 40)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)

    def window_logits_static(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        columns: torch.Tensor,
        key_ok: torch.Tensor,
        key_positions: torch.Tensor,
        cache,
        block_size: int | None,
        keep: torch.Tensor,
        starts: torch.Tensor,
        spans: torch.Tensor,
        given: tuple | None = None,
    ) -> torch.Tensor:
        """Rows' windows with every shape fixed, so that a step can be captured once as a CUDA
        graph and replayed (`graphed_window_logits`): each row's window tokens and RoPE positions
        (B, T), its K/V written at its cache `columns` (B, T; the slot table's last column for a
        padded column), attending over the whole cache buffer (B, ..., S) where `key_ok` (B, S)
        allows it (the keys past what the row sees are masked, not cut off); `key_positions`
        (B, S); `starts` (B,) each row's first logit column; `spans` (B,) how each row's window
        attends where its decoder chooses (`packed_logits`' `canvas`; -1: the model's rule).
        `given`: input vectors for some columns (`hidden`). Returns the logits (B, P, V) of the
        window columns `keep` (B, P) picks (`logit_columns` of each row's window)."""
        key_mask = self.static_key_mask(positions, key_ok, key_positions, block_size, starts, spans)
        h = self.hidden(tokens, positions, key_mask, cache, columns, given=given)
        return self.head(h.gather(1, keep[..., None].expand(-1, -1, h.shape[-1])))

    def static_key_mask(self, positions, key_ok, key_positions, block_size, starts, spans) -> torch.Tensor:
        """(B, 1, T or 1, S) the keys each query of a fixed-shape window attends: those `key_ok`
        allows, within a block-causal model's blocks (`block_size`, default its own). (`spans`:
        for a model whose decoders choose; this one's never do.)"""
        key_mask = key_ok[:, None, None, :]
        if self.args.block_size:
            key_mask = block_causal_mask(positions, key_positions, block_size or self.args.block_size, key_mask)
        return key_mask

    def graphed_window_logits(self):
        """`window_logits_static` through torch.compile(mode="reduce-overhead", dynamic shapes):
        compiled once for the shapes' buckets (`kv.runner.FixedForm`), and on a GPU a CUDA graph
        captured per bucket and replayed; elsewhere, the compiled function."""
        if self._graphed_window is None:
            compiled = torch.compile(self.window_logits_static, mode="reduce-overhead", dynamic=True)

            def step(tokens, positions, columns, key_ok, key_positions, cache, *rest):
                # The graph writes the cache in place: its buffers must be static inputs (as a
                # module's buffers are), or inductor declines to capture a graph that mutates them.
                for buffer in (cache.k, cache.v):
                    torch._dynamo.mark_static_address(buffer)
                # sizes that happen to be equal in one step (rows, block, keys) stay apart, or the
                # next step where they differ compiles again
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return compiled(tokens, positions, columns, key_ok, key_positions, cache, *rest)

            self._graphed_window = step
        return self._graphed_window

    def soft_input(self, signal) -> torch.Tensor:
        """Input vectors (T, D) for a block's columns from a strategy's signal: DMax's soft
        embeddings (`engine.unmasking.SoftTokens`: p E[top] + (1 - p) E[mask], rescaled)."""
        return soft_embeddings(self.tok_embeddings, signal.top_token, signal.top_prob, self.mask_token_id)

    def adapted(self, runs):
        """A context in which the forward's tokens decode with LoRA adapters (`lora.LoRAAdapters.
        tokens`: one index in `self.lora.names` for all, -1 the base, or (index, count) runs in token
        order); nothing without adapters."""
        return contextlib.nullcontext() if self.lora is None or runs is None else self.lora.tokens(runs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        batch_invariant: bool = False,
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:
        """Plain full forward: logits (B, L, V) with the family's native meaning (shifted for Dream).
        `adapters`: per row, the name of the LoRA adapter it runs with (None: the base)."""
        bsz, length = input_ids.shape
        runs = None
        if adapters is not None:
            if self.lora is None or len(adapters) != bsz:
                raise ValueError("adapters: one name (or None) per row, of adapters loaded with the model")
            runs = [(-1 if a is None else self.lora.index(a), length) for a in adapters]
        positions = positions_from_mask(attention_mask, bsz, length, input_ids.device)
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        if self.args.block_size:
            order = self.attention_order(input_ids, positions)
            key_mask = block_causal_mask(order, order, self.args.block_size, key_mask)
        with BatchInvariant() if batch_invariant else contextlib.nullcontext(), self.adapted(runs):
            return self.head(self.hidden(input_ids, positions, key_mask, batch_invariant=batch_invariant))

    def logits_for(
        self,
        x: torch.Tensor,
        start: int,
        end: int,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        block_size: int | None = None,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Logits (B, end-start, V) in which row j predicts token `start + j`, for every family,
        from a full forward of `x` (B, L) (scoring, tools; decoding's forward is `packed_logits`).
        `positions` (B, L) and `key_mask` (B, 1, 1, L) describe the sequence (padding).
        `block_size`: a block-causal model's attention blocks for this call; default its own.
        `batch_invariant`: each row's logits exactly as computed alone (`models.invariance`)."""
        bsz, length = x.shape
        shift = 1 if self.args.shifted_logits else 0
        # Position 0 has no position before it: its row is its own output (as Fast-dLLM v2 pads the
        # shift), read only where a region opens with the prompt's first token, which is never masked.
        first = start == 0 and shift
        if not (0 <= start - shift + first and start < end <= length):
            raise ValueError(f"logits for [{start}, {end}) are not in a sequence of {length}")
        if positions is None:
            positions = positions_from_mask(None, bsz, length, x.device)
        if self.args.block_size:
            order = self.attention_order(x, positions)
            key_mask = block_causal_mask(order, order, block_size or self.args.block_size, key_mask)
        with BatchInvariant() if batch_invariant else contextlib.nullcontext():
            h = self.hidden(x, positions, key_mask, batch_invariant=batch_invariant)
            if first:
                return self.head(torch.cat([h[:, :1], h[:, : end - shift]], 1))
            return self.head(h[:, start - shift : end - shift])
