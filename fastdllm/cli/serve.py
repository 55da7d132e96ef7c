"""`fastdllm serve`: the command line that loads a model and runs the app under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

from ..config import PRESETS, ConfigError, GenerationConfig
from ..server import ServerSettings, create_app, default_model_names

log = logging.getLogger("fastdllm.server")

SERVE_EXAMPLES = """examples:
  fastdllm serve --port 8000
  fastdllm serve --model GSAI-ML/LLaDA-8B-Instruct --device cuda --max-batch-size 16 --threshold 0.9
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "llada-arith", "messages": [{"role": "user", "content": "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"}],
            "max_tokens": 64, "threshold": 0.8}'

  python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x"); print(c.chat.completions.create(model="llada-arith", max_tokens=64, messages=[{"role": "user", "content": "Mia has 10 stamps. Liam has 2 fewer stamps than Mia. Then Liam keeps only one of 4 equal parts of them. How many stamps does Liam have now?"}]).choices[0].message.content)'

  The embedded models answer grade-school word problems like these, and nothing else.
"""  # noqa: E501 (commands as a user types them)


# ---- command line -------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive integer"


def build_parser():
    from .args import ArgumentParser, add_generation_args, add_model_args

    p = ArgumentParser(
        prog="fastdllm serve",
        description="An OpenAI-compatible HTTP server (POST /v1/chat/completions, /v1/completions; GET "
        "/v1/models, /health). The decoding flags set the server defaults; requests override them "
        "with extra body fields of the same names (threshold, block_length, cache, ...).",
        epilog=SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    add_server_args(p.add_argument_group("server"))
    add_generation_args(p, GenerationConfig())
    return p


def add_server_args(s) -> None:
    """The server's own flags (address, auth, limits, batching, tools, presets)."""
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients may use, the first one reported (default: --model as given, or "
        "llada-arith for the embedded model)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("FASTDLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /version "
        "(default: $FASTDLLM_API_KEY; none: open)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 (default %(default)s)",
    )
    s.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running work may finish before queued requests get a 503 (default %(default)s)",
    )
    s.add_argument(
        "--strict",
        action="store_true",
        help="refuse request fields that are otherwise accepted and ignored (metadata, store, tools: [], "
        "response_format text, ...)",
    )
    s.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=8,
        help="most rows decoded together; 1 turns batching off (default %(default)s)",
    )
    s.add_argument(
        "--max-queue",
        type=_positive_int,
        default=64,
        help="most requests waiting; beyond it, 503 (default %(default)s)",
    )
    s.add_argument(
        "--kv-cache-memory",
        type=_positive_int,
        default=None,
        help="MiB of K/V the running rows may hold: requests wait until theirs fits, and one that "
        "never could is refused (default: unbounded; `fastdllm plan --batch B --max-len L` states "
        "what B rows of L positions hold)",
    )
    s.add_argument(
        "--prefix-cache-memory",
        type=_positive_int,
        default=256,
        help="MiB of prompt K/V kept for requests that share a prefix (prefix_cache; pages of the K/V "
        "pool, evicted first when it is full; default %(default)s)",
    )
    s.add_argument(
        "--batch-wait-ms",
        type=float,
        default=0.0,
        help="wait up to this long for more requests before starting a batch (default 0)",
    )
    s.add_argument(
        "--no-continuous-batching",
        dest="continuous",
        action="store_false",
        help="a request waits for the running batch to finish instead of joining it at its next step",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="how tool calls are read from answers (default: the format the model's chat template teaches)",
    )
    s.add_argument(
        "--presets",
        nargs="+",
        default=[],
        metavar="FILE",
        help='preset files (`fastdllm tune --out`) that requests may name by file stem: {"preset": "STEM"}, '
        "beside the named ones (" + ", ".join(PRESETS) + ")",
    )
    s.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        metavar="N",
        help="N copies of the server behind one endpoint, with Ray Serve's routing, health checks and "
        "restarts (pip install 'fastdllm[ray]'); default: one process, no Ray",
    )
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def settings_from_args(args, config: GenerationConfig, family: str | None = None) -> ServerSettings:
    from .args import UserError

    presets = {}
    for path in args.presets:
        try:
            presets[Path(path).stem] = GenerationConfig.from_preset(path, family=family)
        except ConfigError as e:
            raise UserError(f"--presets: {e.detail}") from None
    names = args.served_model_name or default_model_names(args.model)
    return ServerSettings(
        names[0],
        config,
        args.max_batch_size,
        args.max_queue,
        args.batch_wait_ms / 1000,
        aliases=tuple(names[1:]),
        strict=args.strict,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        continuous=args.continuous,
        tool_call_parser=args.tool_call_parser,
        presets=presets,
        kv_cache_bytes=None if args.kv_cache_memory is None else args.kv_cache_memory << 20,
        prefix_cache_bytes=args.prefix_cache_memory << 20,
    )


def main(argv: list[str] | None = None) -> int:
    from .args import UserError, config_from_args, follow_rank_zero

    args = build_parser().parse_args(argv)
    config_from_args(args)  # the decoding flags are checked before anything starts
    if not 0 < args.port < 65536:
        raise UserError(f"--port: must be in 1..65535 (got {args.port})")
    if args.shutdown_grace < 0:
        raise UserError("--shutdown-grace: must be >= 0")
    if args.batch_wait_ms < 0:
        raise UserError("--batch-wait-ms: must be >= 0")
    if args.replicas is not None:
        return serve_replicas(args)
    model, tokenizer, settings = prepare(args, tensor_parallel=True)
    rank, world = getattr(model, "tp", (0, 1))
    if rank:  # every other rank repeats rank 0's commands (`engine.ranks`)
        from ..engine.kv import KVRunner

        kv = KVRunner(model, settings.kv_cache_bytes, settings.prefix_cache_bytes)  # as rank 0's scheduler's
        return follow_rank_zero(model, tokenizer, rank, "serve", kv=kv)
    commands = None
    if world > 1:
        from ..engine.ranks import Commands

        commands = Commands()
    app = create_app(model, tokenizer, settings, commands)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    print(
        f"fastdllm serve: model {settings.model_name!r} on http://{args.host}:{args.port}/v1 "
        f"(max batch {args.max_batch_size}, max queue {args.max_queue})",
        flush=True,
    )
    run_uvicorn(app, args)
    lost = app.state.scheduler.rank_lost
    if lost is not None:
        print(f"fastdllm serve: stopped: {lost}", file=sys.stderr, flush=True)
        return 1
    return 0


def serve_replicas(args) -> int:
    """`--replicas N`: N servers behind one endpoint with Ray Serve (`server.replicas`); each
    replica runs `prepare(args)`."""
    import functools
    import importlib.util

    import torch

    from .args import UserError

    if args.tp != 1:
        raise UserError("--replicas: each replica is one process; --tp inside replicas is not supported")
    try:
        found = importlib.util.find_spec("ray.serve") is not None
    except ImportError:
        found = False
    if not found:
        raise UserError("--replicas: needs Ray Serve: pip install 'fastdllm[ray]'")
    from ..server import replicas

    gpu = str(args.device).startswith("cuda") if args.device else torch.cuda.is_available()
    build = functools.partial(prepare, args)
    app = replicas.deployment(build, args.replicas, gpu, args.max_queue + args.max_batch_size)
    print(f"fastdllm serve: starting {args.replicas} replicas of {args.model or 'llada-arith'!r} ...", flush=True)
    replicas.serve_replicas(app, args.host, args.port)
    return 0


def prepare(args, tensor_parallel: bool = False):
    """The model, tokenizer and server settings the flags name (a replica of `--replicas` runs
    this too), the model compiled first where asked."""
    from .args import config_from_args, load_model_or_exit, with_model_defaults

    model, tokenizer = load_model_or_exit(args, tensor_parallel=tensor_parallel)
    family = getattr(getattr(model, "family", None), "name", None)
    settings = settings_from_args(args, with_model_defaults(args, config_from_args(args), model), family)
    if settings.defaults.compile:  # compiled before the first request, not during it
        from ..engine.generation import warm_up

        print("fastdllm serve: compiling the model's layers ...", flush=True)
        print(f"fastdllm serve: compiled in {warm_up(model, settings.defaults):.1f} s", flush=True)
    return model, tokenizer, settings


def run_uvicorn(app, args) -> None:
    """uvicorn until SIGTERM / SIGINT: then stop accepting, let running work finish for
    --shutdown-grace seconds, answer every request still queued with a 503 error body, and stop."""
    import uvicorn

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_grace + 5
    )
    server = uvicorn.Server(config)
    exit_now = server.handle_exit

    def handle_exit(sig, frame):
        if not server.should_exit:
            timer = threading.Timer(args.shutdown_grace, app.state.scheduler.close, kwargs={"timeout": 1.0})
            timer.daemon = True
            timer.start()
        exit_now(sig, frame)

    server.handle_exit = handle_exit
    # a tensor-parallel rank gone: every request has its 503; the server stops as on SIGTERM
    app.state.scheduler.on_rank_lost = lambda error: setattr(server, "should_exit", True)
    server.run()
