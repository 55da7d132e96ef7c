"""`fastdllm generate`: the answer to one prompt (`fastdllm.cli.session.run_prompt`)."""

from __future__ import annotations

import json
import sys

from ..text.tokenizer import check_text
from .args import UserError, add_text_args, load_model_or_exit, parser, text_config, with_model_defaults

GENERATE_EXAMPLES = """examples:
  fastdllm generate "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"
  fastdllm generate --show --threshold none --gen-length 64 --steps 32 "A hat costs 3 dollars. Ben buys 4 hats and gets 4 dollars off. How much does Ben pay?"  # 32 steps to watch
  fastdllm generate --threshold none --cache none --steps 64 --gen-length 64 "..."   # LLaDA baseline
  fastdllm generate --json --seed 0 --temperature 0.7 "..."
  echo "A pen costs 2 dollars. Ann buys 5 pens and gets 8 dollars off. How much does Ann pay?" | fastdllm generate -
  fastdllm generate --fix $'23:\\n#### 7' "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"  # the last line fixed
  fastdllm generate --gen-length 64 --suffix $'\\n#### 7' "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"  # the working before a suffix
  fastdllm generate --model google/diffusiongemma-26B-A4B-it --image photo.jpg "What is in this picture?"
"""  # noqa: E501 (commands as a user types them)


def read_prompt(arg: str) -> str:
    try:
        text = sys.stdin.read() if arg == "-" else arg
    except UnicodeDecodeError as e:  # a strict stdin
        raise UserError(
            f"the prompt: not valid UTF-8 text (the byte 0x{e.object[e.start]:02x} at byte {e.start})"
        ) from None
    if arg == "-":
        text = text.rstrip("\n")
    if not text.strip():
        raise UserError("the prompt is empty")
    try:
        return check_text(text)
    except ValueError as e:
        raise UserError(f"the prompt: {e}") from None


def prompt_ids(args, model, tokenizer, prompt: str) -> tuple[list[int], bool]:
    """The prompt's ids, through the chat template unless --raw (with one image part per --image
    before its text), and whether the template wrote them."""
    templated = not args.raw and bool(tokenizer.chat_template)
    if args.image and not templated:
        raise UserError("--image: needs the model's chat template (it writes the image placeholders; not with --raw)")
    if args.image and not model.takes_images:
        raise UserError(f"--image: {args.model or 'the default model'} takes text only")
    if not templated:
        return tokenizer.encode((args.system + "\n\n" if args.system else "") + prompt, add_special_tokens=False), False
    user = prompt
    if args.image:
        user = [{"type": "image"} for _ in args.image] + [{"type": "text", "text": prompt}]
    system = [{"role": "system", "content": args.system}] if args.system else []
    return tokenizer.encode_chat([*system, {"role": "user", "content": user}]), True


def main(argv: list[str] | None = None) -> int:
    p = parser(
        "fastdllm generate",
        "Generate the answer to one prompt with a diffusion language model (the embedded default model "
        "unless --model). The prompt goes through the model's chat template unless --raw. The answer goes "
        "to stdout, one line of statistics (tokens, NFE, tokens/step, tokens/s) to stderr.",
        GENERATE_EXAMPLES,
    )
    p.add_argument("prompt", help='the prompt, or "-" to read it from stdin')
    add_text_args(p)
    p.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    p.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image file the prompt asks about, placed before the prompt's text (repeatable; a model "
        "that reads images: DiffusionGemma)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, nfe, tokens_per_step, tokens_per_second, config)",
    )
    args = p.parse_args(argv)
    config = text_config(args)
    prompt = read_prompt(args.prompt)
    from .session import run_prompt  # torch: after the arguments are checked, so that a mistake shows at once

    model, tokenizer = load_model_or_exit(args, tensor_parallel=True)
    config = with_model_defaults(args, config, model)

    ids, templated = prompt_ids(args, model, tokenizer, prompt)
    if not ids:
        raise UserError("the prompt is empty after tokenisation")
    try:
        answer = run_prompt(
            model,
            tokenizer,
            ids,
            config,
            stop=args.stop,
            show=args.show and not args.json,
            keep=args.max_new_tokens,
            show_delay=args.show_delay,
            images=args.image,
        )
    except ValueError as e:  # a prompt or config this model cannot take
        raise UserError(str(e)) from None
    c, o = answer.completion, answer.output
    if args.json:
        record = {
            "text": c.text,
            "tokens": c.num_tokens,
            "finish_reason": c.finish_reason,
            "prompt_tokens": answer.prompt_tokens,
            "nfe": o.nfe,
            "tokens_per_step": round(answer.tokens_per_step, 4),
            "tokens_per_second": round(answer.tokens_per_second, 2),
            "wall_time": round(answer.wall_time, 4),
            "chat_template": templated,
            "model": args.model or "default",
            "config": config.to_dict(),
        }
        if config.logprobs is not None:  # the answer's tokens: (text, log-probability, top (text, log-probability))
            n, texts = c.num_tokens, [tokenizer.decode([t]) for t in o.sequences[0][: c.num_tokens].tolist()]
            tops = o.top_logprobs[0][:n]
            record["logprobs"] = [
                [text, lp, [[tokenizer.decode([a]), b] for a, b in (top or [])]]
                for text, lp, top in zip(texts, o.logprobs[0][:n], tops)
            ]
        print(json.dumps(record, ensure_ascii=False))
        return 0
    print(c.text)
    sys.stdout.flush()
    if not args.no_stats and getattr(model, "tp", (0, 1))[0] == 0:  # rank 0 speaks for every rank
        print(answer.stats_line(), file=sys.stderr)
    return 0
