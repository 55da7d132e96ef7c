"""What the demo shows, without Gradio: a pane's decoding config, and the frames of one answer
denoising, each read from the engine's step events (`engine.generation.iter_generate`), never
re-simulated. `fastdllm.demo.app` puts them on the page."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import PRESETS, ConfigError, GenerationConfig
from ..engine.generation import iter_generate
from ..text.completion import complete
from ..text.infill import encode_infill

MASK_TEXT = "[MASK]"  # how a masked position is shown (Fast-dLLM's demo)
# a canvas position's category (the page colours them)
LABELS = {"mask": "masked", "new": "revealed now", "text": "revealed", "fixed": "fixed"}
# GenerationConfig fields the page does not offer: its own inputs (fixed words, suffix) and
# server-wide switches that compile or change kernels
NOT_ON_THE_PAGE = ("fixed", "suffix", "compile", "cuda_graphs", "deterministic")


def page_fields() -> list[dict]:
    """The decoding options the page has a control for: GenerationConfig's declarations."""
    return [o for o in GenerationConfig.options() if o["name"] not in NOT_ON_THE_PAGE]


def parse_fixed_words(text: str) -> dict[int, str]:
    """Fast-dLLM's demo format, "position:word, position:word": each word at that answer position,
    after a space as that demo encodes it (a word's own token). ConfigError naming `fixed`."""
    fixed: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        pos, sep, word = part.partition(":")
        if not sep or not pos.strip().isdigit() or not word.strip():
            raise ConfigError("fixed", f"expected position:word, got {part!r}")
        if int(pos) in fixed:
            raise ConfigError("fixed", f"position {int(pos)} is given twice")
        fixed[int(pos)] = " " + word.strip()
    return fixed


def pane_config(model, preset: str, options: dict[str, str] | None = None) -> GenerationConfig:
    """A pane's config: a named preset (baseline, fast-dllm, default) or a preset file that
    `fastdllm tune` wrote, fitted to the model's family, with the page's options (text, as the
    CLI parses flags; blank: the preset's value)."""
    given = {
        name: GenerationConfig.parse(name, text)
        for name, text in (options or {}).items()
        if text is not None and str(text).strip() != ""
    }
    if preset in PRESETS:
        config = GenerationConfig.preset(preset)
        return config.fit_to_model(model, keep=set(given), own_block=preset == "default").replace(**given)
    if not Path(preset).is_file():
        raise ConfigError("preset", f"one of {', '.join(PRESETS)}, or a preset file (no file {preset})")
    family = getattr(getattr(model, "family", None), "name", None)
    return GenerationConfig.from_preset(preset, family=family, **given)


@dataclass
class Frame:
    """One picture of a pane: the canvas as (text, category) pairs; when `done`, the answer and
    its figures."""

    canvas: list[tuple[str, str]]
    nfe: int
    done: bool = False
    text: str = ""
    figures: dict = field(default_factory=dict)


class TokenTexts:
    """Each token's text, decoded once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, {}

    def __call__(self, t: int) -> str:
        if t not in self.texts:
            self.texts[t] = self.tokenizer.decode([t])
        return self.texts[t]


def frames(model, tokenizer, prompt_ids: list[int], config: GenerationConfig, kv=None) -> Iterator[Frame]:
    """The frames of one answer: one per step of the loop, then the final one with the answer's
    text and figures (tokens/s over this pane's own decoding time, NFE, forward positions per
    token), its K/V in `kv` (the pane's `engine.kv.KVRunner`). Infill texts are encoded here
    (ConfigError naming the field)."""
    config = encode_infill(config, tokenizer, model.mask_token_id)
    fixed = {p + k for p, ids in config.fixed for k in range(len(ids))}
    text_of = TokenTexts(tokenizer)
    mask = model.mask_token_id
    busy = 0.0  # seconds inside this pane's decoding (panes interleave on one thread)
    events = iter_generate(model, [prompt_ids], config, kv=kv)
    while True:
        t0 = time.perf_counter()
        with torch.inference_mode():
            event = next(events)
        busy += time.perf_counter() - t0
        if event.kind == "block":
            continue
        ids = event.canvas[0].tolist()
        if event.kind == "done":
            stats = event.stats
            c = complete(tokenizer, ids, model.stop_token_ids, None, config.fixed_end)
            figures = {
                "tokens": c.num_tokens,
                "seconds": busy,
                "tokens_per_second": c.num_tokens / busy if busy > 0 else 0.0,
                "nfe": stats.nfe,
                "positions_per_token": sum(stats.forward_positions) / max(1, c.num_tokens),
            }
            yield Frame(_labelled(ids, set(), fixed, mask, text_of), stats.nfe, True, c.text, figures)
            return
        new = set(torch.nonzero(event.revealed[0]).flatten().tolist())
        yield Frame(_labelled(ids, new, fixed, mask, text_of), event.nfe)


def _labelled(ids, new, fixed, mask, text_of) -> list[tuple[str, str]]:
    out = []
    for i, t in enumerate(ids):
        if t == mask:
            out.append((MASK_TEXT, LABELS["mask"]))
        else:
            kind = "fixed" if i in fixed else "new" if i in new else "text"
            out.append((text_of(t), LABELS[kind]))
    return out


def figures_line(figures: dict) -> str:
    return (
        f"{figures['tokens']} tokens · {figures['seconds']:.2f} s · {figures['tokens_per_second']:.1f} tokens/s · "
        f"NFE {figures['nfe']} · {figures['positions_per_token']:.1f} positions/token"
    )
