"""A live terminal view of the canvas while it denoises (`fastdllm generate --show`).

`render_canvas` turns one `StepEvent` into a `rich.text.Text`: every position of the answer region
is drawn as its token, or as a dim mask glyph while still masked; the tokens revealed by this very
step are highlighted, and the block being decoded is underlined and bracketed. `LiveView` feeds
those frames to `rich.live.Live` from generate's `on_step` callback. When the console is not a
terminal (output piped to a file), `LiveView` draws nothing, so the command prints plain text.

    view = LiveView(tokenizer, model.mask_token_id, config.block_length, model.stop_token_ids)
    with view:
        out = generate(model, [ids], config, on_step=view.on_step)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console
from rich.live import Live
from rich.text import Text

MASK_GLYPH = "░"
STOP_GLYPH = "·"  # a stop token (EOS / end of turn) and the EOS filling after it

STYLE_MASK = "grey42"
STYLE_NEW = "bold black on bright_green"
STYLE_TOKEN = ""
STYLE_STOP = "grey50"
STYLE_CURRENT = "underline"
STYLE_BRACKET = "bold cyan"
STYLE_HEADER = "bold"


class TokenTexts:
    """Display text of single token ids, memoised (a canvas is redrawn at every step)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=True)
            self._cache[token_id] = text
        return text


def render_canvas(
    event,
    tokenizer,
    mask_id: int,
    block_length: int,
    stop_token_ids: Sequence[int] = (),
    row: int = 0,
    step: int | None = None,
    token_texts: TokenTexts | None = None,
    header: bool = True,
) -> Text:
    """Render row `row` of a StepEvent's canvas as rich Text.

    Masked positions are `MASK_GLYPH` (dim); stop tokens are `STOP_GLYPH` (dim); tokens revealed by
    this step carry `STYLE_NEW`; the row's current block (`event.blocks`) is underlined and enclosed in
    bold cyan brackets unless the row is finished. With `header`, a first line says which block and
    step this is and how much of the canvas is revealed.
    """
    texts = token_texts or TokenTexts(tokenizer)
    ids = event.canvas[row].tolist()
    revealed = event.revealed[row].tolist() if event.revealed is not None else [False] * len(ids)
    stops = set(stop_token_ids)
    gen_len = len(ids)
    num_blocks = max(1, gen_len // block_length)
    done = event.kind == "done" or (event.finished is not None and event.finished[row])
    block = event.block  # rows move on their own clocks: this row's own block where the event says
    if event.blocks is not None and row in event.rows:
        block = event.blocks[event.rows.index(row)]
    current = None if done else block
    out = Text()
    if header:
        masked = sum(1 for t in ids if t == mask_id)
        parts = [f"block {min(block + 1, num_blocks)}/{num_blocks}"]
        if step is not None:
            parts.append(f"step {step}")
        parts.append(f"{gen_len - masked}/{gen_len} revealed")
        if event.revealed is not None:
            parts.append(f"+{sum(revealed)} this step")
        if done:
            parts.append("finished")
        out.append(" · ".join(parts) + "\n", style=STYLE_HEADER)
    for j, t in enumerate(ids):
        b = j // block_length
        in_current = b == current
        if in_current and j % block_length == 0:
            out.append("[", style=STYLE_BRACKET)
        if t == mask_id:
            glyph, style = MASK_GLYPH, STYLE_MASK
        else:
            glyph, style = (STOP_GLYPH, STYLE_STOP) if t in stops else (texts(t), STYLE_TOKEN)
            if revealed[j]:  # a stop token just revealed is news too (models often fix the end first)
                style = STYLE_NEW
        if in_current:
            style = f"{style} {STYLE_CURRENT}".strip()
        if glyph:
            out.append(glyph, style=style or None)
        if in_current and (j % block_length == block_length - 1 or j == gen_len - 1):
            out.append("]", style=STYLE_BRACKET)
    return out


class LiveView:
    """Draws the denoising canvas in place (rich Live) from generate's `on_step` callback.

    Inactive (every method a no-op) when the console is not a terminal. `delay` sleeps after each
    frame so that fast models can be watched (`paused`: the seconds slept, which the speed figures
    leave out); frames closer than `min_interval` seconds are skipped except at block ends, to keep
    terminal output small.
    """

    def __init__(
        self,
        tokenizer,
        mask_id: int,
        block_length: int,
        stop_token_ids: Sequence[int] = (),
        console: Console | None = None,
        row: int = 0,
        delay: float = 0.0,
        min_interval: float = 1 / 30,
        transient: bool = True,
    ):
        self.console = console or Console()
        self.tokenizer = tokenizer
        self.mask_id = mask_id
        self.block_length = block_length
        self.stop_token_ids = list(stop_token_ids)
        self.row = row
        self.delay = delay
        self.min_interval = min_interval
        self.transient = transient
        self.enabled = self.console.is_terminal
        self.live: Live | None = None
        self.steps = 0
        self.frames = 0
        self.paused = 0.0
        self._last = 0.0
        self._texts = TokenTexts(tokenizer)

    def __enter__(self) -> LiveView:
        if self.enabled:
            self.live = Live(console=self.console, auto_refresh=False, transient=self.transient)
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def on_step(self, event) -> None:
        if event.kind == "step":
            self.steps += 1
        if self.live is None:
            return
        now = time.perf_counter()
        if event.kind == "step" and now - self._last < self.min_interval and self.delay <= 0:
            return
        frame = render_canvas(
            event,
            self.tokenizer,
            self.mask_id,
            self.block_length,
            self.stop_token_ids,
            row=self.row,
            step=self.steps,
            token_texts=self._texts,
        )
        self.live.update(frame, refresh=True)
        self.frames += 1
        self._last = time.perf_counter()
        if self.delay > 0:
            time.sleep(self.delay)
            self.paused += time.perf_counter() - self._last
