"""`fastdllm demo`: two chat panes decoding the same conversation side by side, each under its own
preset, each showing its canvas denoise step by step (after Fast-dLLM's `llada/app.py`).

The page: a model picker (the embedded twins, or any folder or hub id), per pane a preset (a name
or a preset file from `fastdllm tune`), a chat and its canvas; one message box; fixed words
("position:word", Fast-dLLM's format) and a suffix for infilling; and a control for each decoding
option, made from `GenerationConfig`'s declarations (blank: the pane's preset decides). The panes
take turns step by step on one thread, so both canvases move together and each pane's tokens/s
counts only its own decoding."""

from __future__ import annotations

import time

import gradio as gr

from ..config import PRESETS
from ..engine.kv import KVRunner
from ..models.loading import EMBEDDED_MODELS, load
from .frames import LABELS, Frame, figures_line, frames, page_fields, pane_config, parse_fixed_words

PANES = ("left", "right")
COLORS = {LABELS["mask"]: "#444444", LABELS["new"]: "#ff9933", LABELS["text"]: "#6699cc", LABELS["fixed"]: "#66aa66"}
EXAMPLE = "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"


class Models:
    """The models the page has loaded, by name (one at a time stays in memory), each with a K/V
    runner per pane (`engine.kv.KVRunner`): a pane's prompts are stored for that pane alone, so
    neither pane's figures profit from the other's work."""

    def __init__(self, name: str, model, tokenizer, dtype=None, device=None):
        self.dtype, self.device = dtype, device
        self.loaded = {name: (model, tokenizer)}
        self.runners = {name: tuple(KVRunner(model) for _ in PANES)}

    def get(self, name: str):
        if name not in self.loaded:
            try:
                model, tokenizer = load(name or None, dtype=self.dtype, device=self.device)
            except (FileNotFoundError, OSError) as e:
                raise ValueError(f"model: {e}") from None
            self.loaded = {name: (model, tokenizer)}
            self.runners = {name: tuple(KVRunner(model) for _ in PANES)}
        return self.loaded[name]


def turn(models: Models, model_name, message, histories, presets, fixed_text, suffix, delay, options):
    """One user message, answered by both panes: yields (histories, frames) after every step, a
    pane's answer in its history from the step it is done. A message, model or setting that cannot
    be answered raises ValueError naming it, before anything is decoded."""
    if not message or not message.strip():
        raise ValueError("message: type a question first")
    model, tokenizer = models.get(model_name)
    fixed = parse_fixed_words(fixed_text)
    configs = [pane_config(model, p, options).replace(fixed=fixed, suffix=suffix or None) for p in presets]
    histories = [h + [{"role": "user", "content": message}] for h in histories]
    runs = []
    for history, config, kv in zip(histories, configs, models.runners[model_name]):
        ids = tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in history])
        runs.append(frames(model, tokenizer, ids, config, kv))
    latest: list[Frame | None] = [None] * len(runs)
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            latest[i] = next(runs[i])
            if latest[i].done:
                live.remove(i)
        yield (
            [h + [{"role": "assistant", "content": f.text}] if f.done else h for h, f in zip(histories, latest)],
            latest,
        )
        if live and delay:
            time.sleep(delay)


def build(models: Models, model_name: str, presets: tuple[str, str]) -> gr.Blocks:
    with gr.Blocks(title="fastdllm demo") as page:
        gr.Markdown(
            "# fastdllm: diffusion decoding, side by side\n"
            "Each pane answers the same conversation under its own preset; its canvas shows the answer "
            "denoising: masked, revealed at this step, revealed, fixed."
        )
        with gr.Row():
            model_box = gr.Dropdown(
                choices=list(dict.fromkeys([model_name, *EMBEDDED_MODELS])),
                value=model_name,
                allow_custom_value=True,
                label="Model (an embedded twin, a folder or a hub id)",
                elem_id="model",
            )
        histories = [gr.State([]) for _ in PANES]
        preset_boxes, chats, canvases, figures = [], [], [], []
        with gr.Row():
            for side, preset in zip(PANES, presets):
                with gr.Column():
                    preset_boxes.append(
                        gr.Dropdown(
                            choices=list(dict.fromkeys([preset, *PRESETS])),
                            value=preset,
                            allow_custom_value=True,
                            label="Preset (a name, or a preset file from fastdllm tune)",
                            elem_id=f"preset-{side}",
                        )
                    )
                    chats.append(
                        gr.Chatbot(label=f"{side} pane", height=320, render_markdown=False, elem_id=f"chat-{side}")
                    )
                    canvases.append(
                        gr.HighlightedText(
                            label="Canvas",
                            combine_adjacent=False,
                            show_legend=True,
                            color_map=COLORS,
                            elem_id=f"canvas-{side}",
                        )
                    )
                    figures.append(gr.Markdown("", elem_id=f"figures-{side}"))
        with gr.Row():
            message = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, elem_id="message")
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            clear = gr.Button("Clear", scale=1, elem_id="clear")
        notice = gr.Markdown("", elem_id="notice")
        gr.Examples([[EXAMPLE]], inputs=message)
        with gr.Row():
            fixed = gr.Textbox(
                label="Fixed words (infilling)",
                placeholder="0:Tom, 12:apples",
                info="position:word, comma-separated: each word fixed at that answer position",
                elem_id="fixed",
            )
            suffix = gr.Textbox(
                label="Suffix (infilling; LLaDA and Dream)",
                info="text after the answer, which the answer leads into",
                elem_id="suffix",
            )
            # The embedded twins answer in under a second: without a pause the canvas cannot be
            # watched, and the browser falls behind the stream of frames.
            delay = gr.Slider(0.0, 1.0, value=0.1, step=0.05, label="Delay between steps (s)", elem_id="delay")
        option_boxes = {}
        with gr.Accordion(
            "Decoding options (GenerationConfig; blank: the pane's preset)", open=False, elem_id="options"
        ):
            for opt in page_fields():
                option_boxes[opt["name"]] = gr.Textbox(
                    label=opt["name"], info=opt["help"], placeholder=opt["kind"], elem_id=f"opt-{opt['name']}"
                )
        names = list(option_boxes)

        def respond(
            model_name, text, left_history, right_history, left_preset, right_preset, fixed, suffix, delay, *opts
        ):
            run = turn(
                models,
                model_name,
                text,
                [left_history, right_history],
                [left_preset, right_preset],
                fixed,
                suffix,
                delay,
                dict(zip(names, opts)),
            )
            try:
                for hs, latest in run:
                    yield (
                        *hs,
                        *hs,
                        *[f.canvas if f else None for f in latest],
                        *[figures_line(f.figures) if f.done else f"step… NFE {f.nfe}" for f in latest],
                        "",
                        "",
                    )
            except ValueError as e:  # one line on the page; the conversation and the message stay
                yield (*[gr.update()] * 8, gr.update(), f"**Not answered.** {e}")

        inputs = [model_box, message, *histories, *preset_boxes, fixed, suffix, delay, *option_boxes.values()]
        outputs = [*histories, *chats, *canvases, *figures, message, notice]
        send.click(respond, inputs, outputs)
        message.submit(respond, inputs, outputs)
        clear.click(
            lambda: ([], [], [], [], None, None, "", "", ""), None, [*histories, *chats, *canvases, *figures, notice]
        )
    return page
