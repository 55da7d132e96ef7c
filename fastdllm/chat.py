"""`fastdllm generate` and `fastdllm chat`: text in, text out, optionally watching the canvas denoise.

Both commands load the embedded default model unless `--model` is given, take every decoding
option as a flag (the GenerationConfig names, see `fastdllm.cli_args.add_generation_args`), decode the
answer with `fastdllm.text.complete` (stop tokens, `--stop` strings) and print one line of
statistics on stderr. `--show` draws the canvas live (fastdllm.live_view) when stdout is a terminal.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from .cli_args import ArgumentParser, UserError, add_generation_args, add_model_args
from .config import GenerationConfig
from .generation import GenerationOutput, generate
from .text import Completion, complete

GENERATE_EXAMPLES = """examples:
  fastdllm generate "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"
  fastdllm generate --show --show-delay 0.05 "Ann has 12 pencils. She gives 4 away. How many are left?"
  fastdllm generate --threshold none --cache none --steps 64 --gen-length 64 "..."   # LLaDA baseline
  fastdllm generate --json --seed 0 --temperature 0.7 "..."
  echo "Mia has 3 books." | fastdllm generate -
  fastdllm generate --raw "Question: 2 + 3 = ?\\nAnswer:"        # no chat template
"""

CHAT_EXAMPLES = """examples:
  fastdllm chat
  fastdllm chat --show --threshold 0.7
  printf 'Tom has 5 apples. He buys 3 more. How many now?\\n/reset\\nhi\\n' | fastdllm chat

commands inside the chat:
  /reset   forget the conversation so far
  /exit    quit (also /quit, or end of input: Ctrl-D)
  /help    show these commands
"""


def _parser(prog: str, description: str, epilog: str) -> ArgumentParser:
    return ArgumentParser(prog=prog, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_common(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_generation_args(p, GenerationConfig())
    out = p.add_argument_group("output")
    out.add_argument("--show", action="store_true",
                     help="draw the canvas live while it denoises (only when stdout is a terminal)")
    out.add_argument("--show-delay", type=float, default=0.0, metavar="SECONDS",
                     help="pause after each drawn step, to watch a fast model (default 0)")
    out.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                     help="at most N tokens: decodes ceil(N / block length) blocks and cuts the answer to N tokens "
                          "(instead of --gen-length)")
    out.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="cut the answer at this string (repeatable)")
    out.add_argument("--system", default=None, help="a system message put before the conversation")
    out.add_argument("--no-stats", action="store_true", help="do not print the statistics line")


@dataclass
class Answer:
    completion: Completion
    output: GenerationOutput
    prompt_tokens: int

    @property
    def tokens_per_step(self) -> float:
        per_step = self.output.tokens_per_step[0]
        return sum(per_step) / len(per_step) if per_step else 0.0

    def stats_line(self) -> str:
        o = self.output
        tps = self.completion.num_tokens / o.wall_time if o.wall_time > 0 else 0.0
        return (f"[{self.completion.num_tokens} tokens · {o.nfe} NFE · {self.tokens_per_step:.2f} tokens/step · "
                f"{tps:.1f} tokens/s · {o.wall_time:.2f} s]")


def run_prompt(model, tokenizer, ids: list[int], config: GenerationConfig, stop=None, show: bool = False,
               show_delay: float = 0.0, console=None, keep: int | None = None) -> Answer:
    """Generate for one prompt (token ids), with the live view if asked; user mistakes as UserError.
    `keep`: cut the answer to that many tokens (--max-new-tokens)."""
    limit = model.args.max_seq_len
    if len(ids) + config.gen_length > limit:
        raise UserError(f"the prompt ({len(ids)} tokens) + --gen-length ({config.gen_length}) exceeds the "
                        f"model's context of {limit} tokens")
    on_step, view = None, None
    if show:
        from .live_view import LiveView

        view = LiveView(tokenizer, model.mask_token_id, config.block_length, model.stop_token_ids,
                        console=console, delay=show_delay)
        on_step = view.on_step if view.enabled else None
    try:
        if view is not None and view.enabled:
            with view:
                out = generate(model, [ids], config, on_step=on_step)
        else:
            out = generate(model, [ids], config)
    except ValueError as e:  # prompt/config mistakes found by the generation loop
        raise UserError(str(e)) from None
    completion = complete(tokenizer, out.sequences[0][:keep], model.stop_token_ids, stop)
    return Answer(completion, out, len(ids))


def _with_max_new_tokens(config: GenerationConfig, n: int | None) -> GenerationConfig:
    """--max-new-tokens N: decode whole blocks covering N tokens (the answer is cut back to N)."""
    if n is None:
        return config
    if n < 1:
        raise UserError("--max-new-tokens: must be a positive integer")
    return config.replace(gen_length=math.ceil(n / config.block_length) * config.block_length, steps=None)


def _read_prompt(arg: str) -> str:
    text = sys.stdin.read() if arg == "-" else arg
    if arg == "-":
        text = text.rstrip("\n")
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


class ChatSession:
    """A conversation: the history of messages, re-encoded with the chat template at every turn.

    When the history no longer fits the context (prompt + gen_length), the oldest turns are dropped
    (the system message stays)."""

    def __init__(self, model, tokenizer, config: GenerationConfig, system: str | None = None, stop=None,
                 keep: int | None = None):
        if not tokenizer.chat_template:
            raise UserError("this model's tokenizer has no chat template; use `fastdllm generate --raw` instead")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.system, self.stop, self.keep = system, stop, keep
        self.messages: list[dict] = []
        self.dropped_turns = 0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self) -> list[int]:
        limit = self.model.args.max_seq_len - self.config.gen_length
        ids = self.tokenizer.encode_chat(self.messages)
        first = 1 if self.system else 0
        while len(ids) > limit and len(self.messages) - first > 1:
            del self.messages[first : first + 2]  # the oldest user + assistant pair
            self.dropped_turns += 1
            ids = self.tokenizer.encode_chat(self.messages)
        return ids

    def send(self, text: str, show: bool = False, show_delay: float = 0.0) -> Answer:
        self.messages.append({"role": "user", "content": text})
        try:
            answer = run_prompt(self.model, self.tokenizer, self._prompt_ids(), self.config, stop=self.stop,
                                keep=self.keep,
                                show=show, show_delay=show_delay)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": answer.completion.text})
        return answer


def main_generate(argv: list[str] | None = None) -> int:
    """`fastdllm generate` (kept here under its old name; the command lives in fastdllm.commands.generate)."""
    from .commands.generate import main

    return main(argv)


def main_chat(argv: list[str] | None = None) -> int:
    """`fastdllm chat` (kept here under its old name; the command lives in fastdllm.commands.chat)."""
    from .commands.chat import main

    return main(argv)
