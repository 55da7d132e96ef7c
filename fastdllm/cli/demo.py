"""`fastdllm demo`: the side-by-side Gradio demo (`fastdllm.demo.app`; the `demo` extra)."""

from __future__ import annotations

import ipaddress
import os

from .args import UserError, add_model_args, load_model_or_exit, parser

DEMO_EXAMPLES = """examples:
  fastdllm demo                                   # http://127.0.0.1:7860, the embedded model
  fastdllm demo --left baseline --right fast-dllm
  fastdllm demo --model dream-arith --right arith.json      # a preset file from fastdllm tune
  fastdllm demo --host 0.0.0.0 --auth alice:secret          # beyond this machine: a login
"""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = parser(
        "fastdllm demo",
        "Two chat panes decoding the same conversation side by side, each under its own preset, with "
        "each answer's canvas shown as it denoises (Gradio; install with pip install 'fastdllm[demo]').",
        DEMO_EXAMPLES,
    )
    add_model_args(p)
    p.add_argument("--left", default="baseline", help="the left pane's preset: a name or a preset file (%(default)s)")
    p.add_argument("--right", default="default", help="the right pane's preset (%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=7860, help="port (default %(default)s)")
    p.add_argument("--auth", default=None, metavar="USER:PASSWORD", help="Gradio's own login")
    p.add_argument(
        "--api-key",
        default=os.environ.get("FASTDLLM_API_KEY"),
        help="a login whose password is this key, any user name (default: $FASTDLLM_API_KEY)",
    )
    args = p.parse_args(argv)
    auth = None
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise UserError("--auth: expected USER:PASSWORD")
        auth = (user, password)
    elif args.api_key:
        key = args.api_key
        auth = lambda _user, password: password == key  # noqa: E731
    if not _loopback(args.host) and auth is None:
        raise UserError(
            f"--host {args.host}: the demo would be open to the network; give --auth USER:PASSWORD or --api-key KEY"
        )
    try:
        from ..demo.app import Models, build
    except ImportError as e:
        raise UserError(f"the demo needs Gradio: pip install 'fastdllm[demo]' ({e})") from None
    model, tokenizer = load_model_or_exit(args)
    name = args.model or "llada-arith"
    page = build(Models(name, model, tokenizer, args.dtype, args.device), name, (args.left, args.right))
    print(f"fastdllm demo: http://{args.host}:{args.port}", flush=True)
    page.queue().launch(server_name=args.host, server_port=args.port, auth=auth, show_error=True, quiet=True)
    return 0
