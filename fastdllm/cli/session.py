"""One answer (`run_prompt`) and a conversation (`ChatSession`): text in, text out, optionally
watching the canvas denoise (`fastdllm.cli.live_view`), the answer decoded by `fastdllm.text.completion.complete`
(stop tokens, stop strings). What `fastdllm generate` and `fastdllm chat` run."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GenerationConfig
from ..engine.generation import GenerationOutput, generate
from ..engine.ranks import LocalCommands
from ..text.completion import Completion, complete
from ..text.images import open_image, split_images
from ..text.infill import encode_infill


@dataclass
class Answer:
    completion: Completion
    output: GenerationOutput
    prompt_tokens: int
    paused: float = 0.0  # seconds the live view slept between frames (`LiveView.paused`)

    @property
    def wall_time(self) -> float:
        """The decode's seconds, without the live view's pauses."""
        return max(self.output.wall_time - self.paused, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.completion.num_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """The answer's tokens (to its end, not the stop tokens that pad the canvas after it) per forward."""
        return self.completion.num_tokens / self.output.nfe if self.output.nfe else 0.0

    def stats_line(self) -> str:
        return (
            f"[{self.completion.num_tokens} tokens · {self.output.nfe} NFE · {self.tokens_per_step:.2f} tokens/step · "
            f"{self.tokens_per_second:.1f} tokens/s · {self.wall_time:.2f} s]"
        )


def run_prompt(
    model,
    tokenizer,
    ids: list[int],
    config: GenerationConfig,
    stop=None,
    show: bool = False,
    show_delay: float = 0.1,
    console=None,
    keep: int | None = None,
    commands=None,
    images: list | None = None,
) -> Answer:
    """Generate for one prompt (token ids), with the live view if asked; a prompt or config the
    model cannot take raises ValueError. `keep`: cut the answer to that many tokens. `commands`
    (`engine.ranks.Commands`): the other ranks of a tensor-parallel model decode it too.
    `images`: what the prompt's image placeholders stand for (`generate`'s `images`)."""
    limit = model.args.max_seq_len
    config = encode_infill(config, tokenizer, model.mask_token_id, keep)
    suffix = len(config.suffix or ())
    if len(ids) + config.gen_length + suffix > limit:
        raise ValueError(
            f"the prompt ({len(ids)} tokens) + gen_length ({config.gen_length})"
            + (f" + suffix ({suffix} tokens)" if suffix else "")
            + f" exceeds the model's context of {limit} tokens"
        )
    on_step, view = None, None
    if show:
        from .live_view import LiveView

        view = LiveView(
            tokenizer, model.mask_token_id, config.block_length, model.stop_token_ids, console=console, delay=show_delay
        )
        on_step = view.on_step if view.enabled else None
    run = LocalCommands() if commands is None else commands
    images = [images] if images else None
    command = ("generate", [ids], config, images)
    if view is not None and view.enabled:
        with view:
            out = run.run(command, generate, model, [ids], config, on_step=on_step, images=images)
    else:
        out = run.run(command, generate, model, [ids], config, images=images)
    completion = complete(tokenizer, out.sequences[0][:keep], model.stop_token_ids, stop, config.fixed_end)
    prompt_tokens = len(model.placed_ids(ids, images[0])) if images else len(ids)  # its pictures' soft tokens too
    return Answer(completion, out, prompt_tokens, view.paused if view is not None else 0.0)


class ChatSession:
    """A conversation: the history of messages, re-encoded with the chat template at every turn.

    When the history no longer fits the context (prompt + gen_length), the oldest turns are dropped
    (the system message stays)."""

    def __init__(
        self,
        model,
        tokenizer,
        config: GenerationConfig,
        system: str | None = None,
        stop=None,
        keep: int | None = None,
        commands=None,
    ):
        if not tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use `fastdllm generate --raw` instead")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.system, self.stop, self.keep, self.commands = system, stop, keep, commands
        self.messages: list[dict] = []
        self.dropped_turns = 0
        self.pictures: list[str] = []  # attached to the next message (`attach`)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.pictures = []

    def attach(self, path: str) -> None:
        """A picture for the next message (a model that reads images)."""
        if not self.model.takes_images:
            raise ValueError("/image: this model takes text only")
        open_image(path)  # refused now, not with the next message
        self.pictures.append(path)

    def _prompt(self) -> tuple[list[int], list]:
        """The conversation's ids and the pictures its placeholders stand for."""
        limit = self.model.args.max_seq_len - self.config.gen_length
        first = 1 if self.system else 0
        while True:
            messages, pictures = split_images(self.messages)
            ids = self.tokenizer.encode_chat(messages)
            if len(ids) <= limit or len(self.messages) - first <= 1:
                return ids, pictures
            del self.messages[first : first + 2]  # the oldest user + assistant pair
            self.dropped_turns += 1

    def send(self, text: str, show: bool = False, show_delay: float = 0.1) -> Answer:
        content = text
        if self.pictures:
            content = [*({"type": "image", "path": p} for p in self.pictures), {"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content})
        try:
            ids, pictures = self._prompt()
            answer = run_prompt(
                self.model,
                self.tokenizer,
                ids,
                self.config,
                stop=self.stop,
                keep=self.keep,
                show=show,
                show_delay=show_delay,
                commands=self.commands,
                images=pictures,
            )
        except BaseException:
            self.messages.pop()
            raise
        self.pictures = []
        self.messages.append({"role": "assistant", "content": answer.completion.text})
        return answer
