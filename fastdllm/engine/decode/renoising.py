"""DiffusionGemma's decoding (transformers' `DiffusionGemmaGenerationMixin.generate`): no mask token.

A block (a *canvas* of the model's `canvas_length`) opens as uniform random tokens, drawn when it
opens (`RenoisingStrategy.open_block`; the family has no mask token: `DecodingRules.noise_canvas`).
Step i of at most N (`max_denoising_steps`)
divides the logits by a temperature falling linearly from `t_max` to `t_min`
(t = t_min + (t_max - t_min) (N - i) / N), samples a token at every position (the *denoiser*
canvas), and keeps the lowest-entropy samples whose summed entropy less the largest is at most
`entropy_bound` (`EntropyBound`); every other position is *renoised* with a fresh uniform token.
The step's logits, softmaxed, condition the next forward (self-conditioning: `Decision.signal`,
`SelfConditioning`, which the model turns into its input, `DiffusionGemma.soft_input`). The canvas is done once its
argmax has held for `stability_threshold` steps with a mean entropy under `confidence_threshold`
(None: no such stop), or after N steps; it then becomes its argmax.

Randomness: each row draws from its own generator, in the reference's order (the canvas when its
block opens; per step the samples, then the renoising tokens), one row's shapes at a time, so a row
alone draws exactly what the reference draws for a batch of one under the same seed; in a batch each
row draws as alone, where the reference draws the batch's rows from one stream.
"""

from __future__ import annotations

import torch

from ...config import GenerationConfig, selection_rule_name
from ..registry import SELECTION_RULES
from .base import Decoder, DecodeView, register_decoder
from .decision import Decision, SelfConditioning
from .rules import SelectionRule


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """`torch.distributions.Categorical(logits=...).entropy()`, as the reference computes it."""
    normalized = logits - logits.logsumexp(-1, keepdim=True)
    probs = normalized.softmax(-1)
    return -(normalized.clamp(min=torch.finfo(normalized.dtype).min) * probs).sum(-1)


@SELECTION_RULES.register
class EntropyBound(SelectionRule):
    """The entropy-bound acceptance (`EntropyBoundSampler.accept_canvas`): positions sorted by
    entropy (ascending, `torch.sort` as there), the k lowest kept while their cumulative entropy
    less the k-th stays at most the bound. `conf` is the negative entropy."""

    name = "entropy_bound"

    def __init__(self, bound: float):
        self.bound = bound

    @classmethod
    def from_config(cls, config):
        return cls(config.entropy_bound)

    def select(self, conf, masked, clock, generators, draws):
        ent = -conf
        ordered, order = torch.sort(ent, dim=-1, descending=False)
        keep = ordered.cumsum(-1) - ordered <= self.bound
        return torch.zeros_like(keep).scatter(-1, order, keep)


@register_decoder(EntropyBound.name)
class RenoisingStrategy(Decoder):
    """DiffusionGemma's decisions, one complete decision per step: the canvas to write (the renoised
    canvas, or the argmax once done), what it accepted (`chosen`), whether the block is done, the
    self-conditioning signal of the next step, and per row the argmax history its stop rule reads
    (`Decision.carry`)."""

    draws_randomness = True

    def __init__(self, config, vocab_size: int | None = None):
        self.vocab_size = vocab_size
        self.rule = EntropyBound.from_config(config)
        self.steps, self.t_min, self.t_max = config.max_denoising_steps, config.t_min, config.t_max
        self.stability, self.confidence = config.stability_threshold, config.confidence_threshold

    @classmethod
    def from_config(cls, config, model=None, cache=None) -> RenoisingStrategy:
        return cls(config, None if model is None else model.args.vocab_size)

    def open_block(self, tokens, generator):
        """The canvas: uniform random tokens from the row's generator, in the reference's order
        (before the block's first step draws)."""
        return torch.randint(0, self.vocab_size, (1, len(tokens)), generator=generator, device=tokens.device)[0]

    def temperatures(self, steps: list[int], device) -> torch.Tensor:
        """(B,) the reference's float32 temperature at each row's step (0-based) of its canvas."""
        remaining = torch.tensor([self.steps - step for step in steps], dtype=torch.int32, device=device)
        return self.t_min + (self.t_max - self.t_min) * (remaining / self.steps)

    def decide(self, logits, view: DecodeView) -> Decision:
        """Every row's step at once, with no host read: only the draws are per row, each from its
        own generator in the reference's order (its sample, then its noise)."""
        block, clock, generators, carry = view.block, view.clock, view.generators, view.carry
        bsz, length, vocab = logits.shape
        dev = block.device
        processed = logits.float() / self.temperatures(clock.step, dev)[:, None, None]
        probs = processed.softmax(-1, dtype=torch.float32)
        sampled, noise = torch.empty_like(block), torch.empty_like(block)
        for i, g in enumerate(generators):
            sampled[i] = torch.multinomial(probs[i], 1, generator=g).squeeze(-1)
            noise[i] = torch.randint(0, vocab, (1, length), generator=g, device=dev)[0]
        argmax = processed.argmax(-1)
        ent = entropy(processed)
        accepted = self.rule.select(-ent, None, clock, generators, None)
        canvas = torch.where(accepted, sampled, noise)
        if self.stability == 0:
            stable, histories = torch.ones(bsz, dtype=torch.bool, device=dev), [None] * bsz
        else:
            fresh = torch.full((self.stability, length), -1, dtype=torch.long, device=dev)
            history = torch.stack([fresh if carry is None or carry[i] is None else carry[i] for i in range(bsz)])
            stable = (history == argmax[:, None]).flatten(1).all(-1)
            history = torch.roll(history, -1, 1)
            history[:, -1] = argmax
            histories = list(history.unbind(0))
        confident = ent.mean(-1) < self.confidence if self.confidence is not None else torch.zeros_like(stable)
        last = torch.tensor([step + 1 >= self.steps for step in clock.step], device=dev)
        done = (stable & confident) | last
        return Decision(
            torch.where(done[:, None], argmax, canvas),
            accepted | done[:, None],
            edited=torch.ones_like(accepted),
            block_done=done,
            signal=SelfConditioning(processed),
            carry=histories,
        )


def check_canvas(model, config: GenerationConfig) -> None:
    """A family with no mask token (DiffusionGemma) decodes its canvases with their own rule, in
    its canvas length, with a cache whose windows stay exact; a masked family cannot take that
    rule. A ValueError names the field (the server answers it with a 400 before anything decodes)."""
    family = getattr(model, "family", None)
    noise_canvas = family is not None and family.rules.noise_canvas
    renoising = selection_rule_name(config) == "entropy_bound"
    if not noise_canvas:
        if renoising:
            raise ValueError("unmasking: entropy_bound renoises a canvas with no mask token (DiffusionGemma's)")
        return
    canvas = model.args.extra["canvas_length"]
    for ok, name, why in (
        (renoising, "unmasking", "must be entropy_bound: this model has no mask token"),
        (config.block_length == canvas, "block_length", f"must be the model's canvas_length, {canvas}"),
        (config.cache in ("none", "prefix", "dual"), "cache", "must be none, prefix or dual for this model"),
        (
            config.cache == "none" or config.refresh in ("full", "vicinity"),
            "refresh",
            "must be full or vicinity: the next canvas's first forward commits this one as the encoder does",
        ),
        (config.suffix_window == 0, "suffix_window", "must be 0: nothing after a canvas is part of a forward"),
        (not config.fixed, "fixed", "not with a canvas that every step rewrites"),
        (config.suffix is None, "suffix", "not with this model: a canvas attends only to what is before it"),
        (config.parallel_blocks == 1, "parallel_blocks", "must be 1 for this model"),
    ):
        if not ok:
            raise ValueError(f"{name}: {why} (got {getattr(config, name)!r})")
