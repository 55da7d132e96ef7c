"""`fastdllm chat`: a multi-turn conversation (`fastdllm.cli.session.ChatSession`)."""

from __future__ import annotations

import sys

from .args import (
    UserError,
    add_text_args,
    follow_rank_zero,
    load_model_or_exit,
    parser,
    text_config,
    with_model_defaults,
)

CHAT_EXAMPLES = """examples:
  fastdllm chat
  fastdllm chat --show --threshold 0.7
  printf 'A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?\\n/reset\\nA hat costs 3 dollars. Ben buys 4 hats and gets 4 dollars off. How much does Ben pay?\\n' | fastdllm chat
  torchrun --nproc-per-node 2 -m fastdllm chat --tp 2

commands inside the chat:
  /image PATH  a picture for the next message (a model that reads images: DiffusionGemma)
  /reset   forget the conversation so far
  /exit    quit (also /quit, or end of input: Ctrl-D)
  /help    show these commands
"""  # noqa: E501 (commands as a user types them)


def main(argv: list[str] | None = None) -> int:
    p = parser(
        "fastdllm chat",
        "Multi-turn chat with a diffusion language model through its chat template (the embedded default "
        "model unless --model). Reads one message per line from stdin, so it also works with piped input; "
        "answers go to stdout, statistics to stderr.",
        CHAT_EXAMPLES,
    )
    add_text_args(p)
    args = p.parse_args(argv)
    config = text_config(args)
    from .session import ChatSession  # torch: after the arguments are checked

    model, tokenizer = load_model_or_exit(args, tensor_parallel=True)
    config = with_model_defaults(args, config, model)
    rank, world = getattr(model, "tp", (0, 1))
    if rank:  # the other ranks decode what rank 0 reads (`engine.ranks`)
        return follow_rank_zero(model, tokenizer, rank, "chat")
    commands = None
    if world > 1:
        from ..engine.ranks import Commands

        commands = Commands()
    try:
        session = ChatSession(
            model, tokenizer, config, system=args.system, stop=args.stop, keep=args.max_new_tokens, commands=commands
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        return converse(session, args)
    finally:
        if commands is not None:
            commands.stop()


def converse(session, args) -> int:
    """Read messages from stdin until /exit or its end, and answer each."""
    interactive = sys.stdin.isatty()
    if interactive:
        print("fastdllm chat: type a message; /reset to forget the conversation, /exit to quit.", file=sys.stderr)
    while True:
        try:
            if interactive:
                line = input(">>> ")
            else:
                line = sys.stdin.readline()
                if not line:
                    break
        except EOFError:  # Ctrl-D: end the ">>> " line, so the shell's prompt starts a line of its own
            if interactive:
                print()
            break
        except UnicodeDecodeError as e:  # a strict stdin; the chat goes on
            print(f"fastdllm chat: error: not valid UTF-8 text (the byte 0x{e.object[e.start]:02x})", file=sys.stderr)
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()[0].lower()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                print("(conversation reset)", file=sys.stderr)
            elif cmd == "/image":
                path = line[len(cmd) :].strip()
                try:
                    session.attach(path)
                    print(f"(picture {path} goes with your next message)", file=sys.stderr)
                except ValueError as e:
                    print(f"fastdllm chat: error: {e}", file=sys.stderr)
            elif cmd == "/help":
                print(
                    "/image PATH  a picture for the next message    /reset  forget the conversation    /exit  quit",
                    file=sys.stderr,
                )
            else:
                print(f"unknown command {cmd}; try /help", file=sys.stderr)
            continue
        dropped = session.dropped_turns
        try:
            answer = session.send(line, show=args.show, show_delay=args.show_delay)
        except ValueError as e:  # this turn cannot be answered (e.g. too long); the chat goes on
            print(f"fastdllm chat: error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this answer (the turn is forgotten), not the chat
            if session.commands is not None:  # the other ranks are inside this answer: stop them all
                raise
            print("\n(answer stopped)", file=sys.stderr)
            continue
        if session.dropped_turns > dropped:
            print(f"(dropped {session.dropped_turns - dropped} old turn(s) to fit the context)", file=sys.stderr)
        print(answer.completion.text)
        sys.stdout.flush()
        if not args.no_stats:
            print(answer.stats_line(), file=sys.stderr)
    return 0
