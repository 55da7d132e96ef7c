"""What the commands share: the argument parser that reports mistakes in one line, the model
flags, the decoding flags, generated from `GenerationConfig`'s declarations (one flag per
field, the field's name with dashes), and the text flags of `generate` and `chat`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config import PRESETS, ConfigError, GenerationConfig, read_preset

# Presets that are the decoders of finetunes trained for them (`models.loading.recognized_decoding`).
# Below it a model decodes on one CPU thread unless --threads says otherwise: its steps are too small
# to share between threads, which collapse as soon as another job runs (docs/results.md).
SMALL_MODEL_PARAMETERS = 100_000_000
FINETUNE_PRESETS = ("dparallel", "d3llm", "dmax", "rnd1", "diffusion_gemma", "diffucoder", "dream-coder")


class UserError(Exception):
    """A mistake of the user's (bad flag, missing folder): printed as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports mistakes as a UserError: one line, exit code 2, no usage dump."""

    def error(self, message: str):
        raise UserError(message)


def parser(prog: str, description: str, epilog: str) -> ArgumentParser:
    return ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="checkpoint folder or Hugging Face repo id (default: the embedded model)"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32, bfloat16 or float16 (default auto: the checkpoint's where the device computes it "
        "natively, float32 on a CPU that emulates it)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="PATH|NAME=PATH",
        help="a PEFT LoRA adapter folder, merged into the weights at load (repeatable: merged in order); "
        "NAME=PATH keeps it beside the weights under NAME, as --lora-modules does",
    )
    p.add_argument(
        "--lora-modules",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter kept beside the weights under NAME (repeatable): rows choose one with "
        "--adapter NAME, the server serves each as a model named NAME, and rows of different adapters "
        "decode in one batch",
    )
    p.add_argument("--revision", default=None, help="for a hub id: the branch, tag or commit (default: main)")
    p.add_argument("--local-files-only", action="store_true", help="for a hub id: use the hub cache only, no network")
    p.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "int4"],
        help="weight-only quantization of the linear layers at load (int8 per channel, int4 in groups)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="N",
        help="int4 group size: 32, 64, 128 or 256 (default 128, or the largest that fits the model)",
    )
    p.add_argument("--quantize-head", action="store_true", help="quantize the output head too")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism over N ranks, started by torchrun: torchrun --nproc-per-node N -m fastdllm ... --tp N",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="expert parallelism: with --tp N, each rank holds 1/N of the routed experts whole (default 1: "
        "every expert split by --tp)",
    )
    p.add_argument(
        "--ep-dispatch",
        default="all-reduce",
        choices=["all-reduce", "all-to-all"],
        help="how tokens reach their experts' ranks under --ep (default %(default)s: each rank computes its "
        "experts' share for every token, summed by the layer's all-reduce)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 for a model under 100M parameters, such as the embedded "
        "ones, whose steps are too small to share: with one other job on the machine two threads ran 3.5x "
        "slower than one; torch's own count for larger models)",
    )


def _parser_for(name: str, kind: str):
    def parse(text: str):
        try:
            return GenerationConfig.parse(name, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.detail) from None

    parse.__name__ = kind.replace(" ", "_")  # argparse names it in "invalid <kind> value"
    return parse


def _recording(action_cls):
    """`action_cls` that also records its flag as given (`namespace._explicit`), so that a
    --preset or the checkpoint's defaults fill only the flags the user did not give."""

    class Recording(action_cls):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            namespace._explicit = set(getattr(namespace, "_explicit", ())) | {self.dest}

    return Recording


_StoreRecording = _recording(argparse._StoreAction)


class _AddUp(argparse.Action):
    """A repeatable flag whose parsed values are tuples that add up (--fix 0:A --fix 9:B)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest) if self.dest in getattr(namespace, "_explicit", ()) else ()
        setattr(namespace, self.dest, tuple(given) + tuple(values))


_AddUpRecording = _recording(_AddUp)
_BoolRecording = _recording(argparse.BooleanOptionalAction)


def add_generation_args(p: argparse.ArgumentParser, defaults: GenerationConfig | None = None) -> None:
    """One flag per GenerationConfig field, same names (dashes for underscores), and --preset."""
    d = defaults or GenerationConfig()
    g = p.add_argument_group("decoding (GenerationConfig)")
    g.add_argument(
        "--preset",
        default=None,
        metavar="NAME|FILE",
        help=f"start from a named configuration ({', '.join(PRESETS)}; fast-dllm: as published; baseline: "
        "LLaDA's one token per step) or a preset file that `fastdllm tune` wrote; the flags below override it",
    )
    for opt in GenerationConfig.options():
        name, kind = opt["name"], opt["kind"]
        default = getattr(d, name)
        # a help that says its default in words keeps them, not None beside them
        text = opt["help"] if "(default" in opt["help"] else f"{opt['help']} (default: {default})"
        if kind == "bool":
            g.add_argument(flag(name), dest=name, action=_BoolRecording, default=default, help=text)
        elif kind == "fixed":  # --fix POS:TEXT, repeated
            g.add_argument(
                "--fix",
                flag(name),
                dest=name,
                action=_AddUpRecording,
                type=_parser_for(name, kind),
                default=default,
                help=opt["help"] + "; repeat for more",
                metavar="POS:TEXT",
            )
        else:
            g.add_argument(
                flag(name),
                dest=name,
                action=_StoreRecording,
                type=_parser_for(name, kind),
                default=default,
                help=text,
                metavar=kind.removeprefix("optional ").upper(),
            )


def config_from_args(args: argparse.Namespace, **overrides) -> GenerationConfig:
    names = [n for n in GenerationConfig.field_names() if hasattr(args, n)]
    try:
        if getattr(args, "preset", None):
            given = {n: getattr(args, n) for n in names if n in getattr(args, "_explicit", ())}
            if args.preset in PRESETS:
                return GenerationConfig.preset(args.preset, **{**given, **overrides})
            if not Path(args.preset).is_file():
                raise UserError(f"--preset: one of {', '.join(PRESETS)}, or a preset file (no file {args.preset})")
            args._preset_family = read_preset(args.preset, GenerationConfig.field_names()).get("family")
            return GenerationConfig.from_preset(args.preset, **{**given, **overrides})
        values = {**{n: getattr(args, n) for n in names}, **overrides}
        try:
            return GenerationConfig(**values)
        except ConfigError as e:
            if e.param != "block_length" or "block_length" in {*getattr(args, "_explicit", ()), *overrides}:
                raise
            # The default block length does not divide the --gen-length given: a model whose own
            # decoder sets its blocks (RND1's one block) may still take it, which is known once the
            # model is loaded (`with_model_defaults` raises this error for any other model).
            args._block_length_error = e
            return GenerationConfig(**{**values, "block_length": values["gen_length"]})
    except ConfigError as e:
        raise UserError(f"{flag(e.param)}: {e.detail}") from None


def with_model_defaults(args: argparse.Namespace, config: GenerationConfig, model) -> GenerationConfig:
    """The checkpoint's own generation defaults (Dream's generation_config.json) for the decoding
    flags the user did not give; none with a --preset, which says what to use, but for what the
    model's family needs (a block-diffusion model's block length, and its exact cache where the
    preset has a cache)."""
    family_of_preset = getattr(args, "_preset_family", None)
    if family_of_preset is not None:  # a tuned preset: made for this family, used as written
        family = getattr(model, "family", None)
        if family is not None and family.name != family_of_preset:
            raise UserError(f"--preset: {args.preset} was tuned for {family_of_preset} models, not {family.name}")
        return config
    if getattr(args, "preset", None):
        if args.preset in FINETUNE_PRESETS and getattr(model, "decoding", None) != args.preset:
            print(
                f"warning: --preset {args.preset} is the decoder of checkpoints trained for it; this model was "
                f"not, and may answer worse with it than with the default",
                file=sys.stderr,
            )
        try:
            return config.fit_to_model(
                model, keep=set(getattr(args, "_explicit", ())), own_block=args.preset == "default"
            )
        except ConfigError as e:
            raise UserError(f"{flag(e.param)}: {e.detail} (for this model)") from None
    given = {n: getattr(config, n) for n in getattr(args, "_explicit", ())}
    recognized = getattr(model, "decoding", None)
    new_tokens = getattr(args, "max_new_tokens", None)
    if recognized:  # a checkpoint trained for its own decoder: that decoder, the flags given on top
        print(
            f"decoding with --preset {recognized}, which this checkpoint was trained for ('--preset default': ours)",
            file=sys.stderr,
        )
        family = getattr(model, "family", None)
        needed = family.decoding_defaults(model.args) if family is not None else {}
        # the model's own block (DiffusionGemma's canvas) before the preset checks a given --gen-length
        block = (
            {"block_length": needed["block_length"]} if "block_length" in needed and "block_length" not in given else {}
        )
        try:
            config = GenerationConfig.preset(recognized, **block, **given).fit_to_model(model, keep=set(given))
            return config if new_tokens is None else config.with_max_new_tokens(new_tokens)
        except ConfigError as e:
            raise UserError(f"{flag(e.param)}: {e.detail} (with --preset {recognized})") from None
    deferred = getattr(args, "_block_length_error", None)
    if deferred is not None and (not hasattr(args, "max_new_tokens") or args.max_new_tokens is not None):
        raise UserError(f"{flag(deferred.param)}: {deferred.detail}")
    if deferred is not None:  # --gen-length off the blocks: whole blocks, cut back, as the server's max_tokens
        n = args.max_new_tokens = config.gen_length
        print(
            f"note: --gen-length {n} is not a whole number of blocks: decoding whole blocks and keeping {n} tokens "
            f"(as --max-new-tokens {n}; --block-length sets the blocks)",
            file=sys.stderr,
        )
        given = {k: v for k, v in given.items() if k not in ("gen_length", "block_length")}
        layout = {"gen_length": GenerationConfig.gen_length, "block_length": GenerationConfig.block_length}
        try:
            return GenerationConfig.for_model(model, config.replace(**layout), **given).with_max_new_tokens(n)
        except ConfigError as e:
            raise UserError(f"--gen-length: {e.detail}") from None
    try:
        return GenerationConfig.for_model(model, config, **given)
    except ConfigError as e:
        raise UserError(f"{flag(e.param)}: {e.detail} (with the checkpoint's generation_config.json)") from None


def not_block_decoding(model) -> str | None:
    """Why a model does not decode in Fast-dLLM's blocks (so `bench`'s rows and `tune`'s knobs do
    not apply to it), or None where it does."""
    if model.family.rules.noise_canvas:
        return f"{model.family.name} has no mask token (it renoises whole canvases)"
    if model.args.masks_last:
        return f"{model.family.name} decodes with its own sliding window over causal attention (blocks of one position)"
    return None


def load_model_or_exit(args: argparse.Namespace, tensor_parallel: bool = False):
    """The model the flags name. With `--tp N` (where the command runs tensor-parallel:
    `tensor_parallel`) the ranks torchrun started join, each keeps its part of the model, and only
    rank 0 writes to stdout."""
    import torch

    from ..models import tp
    from ..models.loading import load

    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise UserError(f"--threads: must be a positive integer (got {args.threads})")
        torch.set_num_threads(args.threads)
    parts = getattr(args, "tp", 1)
    if parts != 1 and not tensor_parallel:
        raise UserError("--tp: this command does not run tensor-parallel (generate, chat, eval, bench and serve do)")
    ep = getattr(args, "ep", 1)
    if ep not in (1, parts):
        raise UserError(f"--ep: must be 1 or the --tp ranks ({parts}); got {ep}")
    try:
        rank, world = tp.init(parts, args.device)
        model, tokenizer = load(
            args.model,
            dtype=args.dtype,
            device=args.device,
            revision=getattr(args, "revision", None),
            local_files_only=getattr(args, "local_files_only", False),
            quantize=getattr(args, "quantize", None),
            group_size=getattr(args, "group_size", None),
            quantize_head=getattr(args, "quantize_head", False),
            tp=(rank, world),
            ep=ep,
            ep_dispatch=getattr(args, "ep_dispatch", "all-reduce"),
            adapters=[p for p in getattr(args, "lora", None) or [] if not _named(p)] or None,
            lora_modules=lora_modules(
                [p for p in getattr(args, "lora", None) or [] if _named(p)]
                + (getattr(args, "lora_modules", None) or [])
            ),
        )
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    if getattr(args, "threads", None) is None and model.device.type == "cpu":
        if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS:
            torch.set_num_threads(1)
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 speaks for every rank
    elif model.dtype_note:
        print(model.dtype_note, file=sys.stderr)
    return model, tokenizer


def follow_rank_zero(model, tokenizer, rank: int, command: str, kv=None) -> int:
    """A tensor-parallel rank other than 0: repeat rank 0's commands until it stops (`engine.ranks`;
    `kv`: the runner of its decoders' K/V); one line and exit status 1 when rank 0 is gone."""
    from ..engine.ranks import follow
    from ..models.tp import RankLost

    try:
        follow(model, tokenizer, kv=kv)
    except RankLost as e:
        print(f"fastdllm {command}: rank {rank} stopped: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def add_text_args(p: argparse.ArgumentParser) -> None:
    """The model, decoding and output flags of `generate` and `chat`."""
    add_model_args(p)
    add_generation_args(p, GenerationConfig())
    out = p.add_argument_group("output")
    out.add_argument(
        "--show", action="store_true", help="draw the canvas live while it denoises (only when stdout is a terminal)"
    )
    out.add_argument(
        "--show-delay",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="with --show: pause after each drawn step, so that a fast model can be watched (default "
        "%(default)s; the speed figures leave the pauses out)",
    )
    out.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="at most N tokens: decodes ceil(N / block length) blocks and cuts the answer to N tokens "
        "(instead of --gen-length)",
    )
    out.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="cut the answer at this string (repeatable)"
    )
    out.add_argument("--system", default=None, help="a system message put before the conversation")
    out.add_argument("--no-stats", action="store_true", help="do not print the statistics line")


def text_config(args: argparse.Namespace) -> GenerationConfig:
    """The decoding flags of `generate` / `chat`, with --max-new-tokens (GenerationConfig.with_max_new_tokens)."""
    if args.show_delay < 0:
        raise UserError("--show-delay: must be >= 0")
    config = config_from_args(args)
    if args.max_new_tokens is None:
        return config
    try:
        return config.with_max_new_tokens(args.max_new_tokens)
    except ConfigError as e:
        raise UserError(f"{flag(e.param)}: {e.detail}") from None


def lora_modules(pairs: list[str] | None) -> dict[str, str] | None:
    """--lora-modules NAME=PATH ... as {name: path}; a UserError naming the flag when one is not."""
    if not pairs:
        return None
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--lora-modules: expected NAME=PATH, got {pair!r}")
        if name in out:
            raise UserError(f"--lora-modules: {name!r} given twice")
        out[name] = path
    return out


def _named(value: str) -> bool:
    """Whether a --lora value is NAME=PATH (a name, then a path) rather than a folder to merge."""
    import os

    name, sep, _ = value.partition("=")
    return bool(sep) and not os.path.exists(value) and name.replace("-", "").replace("_", "").replace(".", "").isalnum()
