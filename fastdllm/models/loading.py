"""Load and save checkpoints in their real Hugging Face layout (config.json + safetensors).

`load` accepts a local folder or a hub repo id, reads the family from `model_type`, maps the
checkpoint's weight names onto our modules, and checks every tensor's name and shape before
anything reaches torch. Weights are only ever read from safetensors: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..text.tokenizer import Tokenizer, load_tokenizer
from . import Transformer, family_of

ASSETS_DIR = Path(__file__).resolve().parents[1] / "embedded" / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "llada-arith"
# Models shipped in the package, loadable by name: the default LLaDA-format model, its Dream-format
# twin, its block-diffusion twin in SDAR's layout, that twin's mixture of experts in LLaDA2's, and a
# DiffusionGemma (no mask token) trained on the same task (see docs/model-card.md).
EMBEDDED_MODELS = ("llada-arith", "dream-arith", "sdar-arith", "llada2-arith", "gemma-arith")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


def resolve_dtype(dtype) -> torch.dtype | None:
    """A dtype given by name or as a torch dtype; None for "auto" (and None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# The CPU features with which PyTorch computes a half-precision dtype natively; without them a CPU
# emulates it, and decoding runs several times slower than in float32.
NATIVE_ON_CPU = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def auto_dtype(checkpoint: torch.dtype, device) -> tuple[torch.dtype, str | None]:
    """`dtype="auto"`: the checkpoint's dtype where `device` computes it natively (any accelerator;
    a CPU with the features of `NATIVE_ON_CPU`), float32 on a CPU without them. Returns the dtype
    and, where it is not the checkpoint's, why."""
    if checkpoint == torch.float32 or torch.device(device).type != "cpu":
        return checkpoint, None
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if any(capabilities.get(feature) for feature in NATIVE_ON_CPU.get(checkpoint, ())):
        return checkpoint, None
    name = str(checkpoint).removeprefix("torch.")
    return torch.float32, f"this CPU has no native {name}: decoding in float32 (--dtype {name} keeps the checkpoint's)"


def resolve_model_path(
    path_or_repo_id: str | os.PathLike | None,
    revision: str | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Path:
    """A local folder as is; the name of an embedded model; otherwise a hub repo id downloaded (or
    found in the hub cache) at `revision` (a branch, tag or commit; default the main branch).
    `local_files_only` never goes to the network; `token` defaults to huggingface_hub's own
    (HF_TOKEN or the stored login)."""
    if path_or_repo_id is None:
        return DEFAULT_MODEL_DIR
    path, text = Path(path_or_repo_id).expanduser(), str(path_or_repo_id)
    if path.is_dir():
        return path
    if text in EMBEDDED_MODELS and (ASSETS_DIR / text).is_dir():
        return ASSETS_DIR / text
    if text.lower().endswith(".gguf") and not path.exists():  # a file's name, never a repo id
        raise FileNotFoundError(f"no GGUF file {text} (a llama.cpp .gguf file, a folder, or a hub repo id owner/name)")
    looks_like_repo = text.count("/") == 1 and not text.startswith((".", "/", "~")) and not path.exists()
    if not looks_like_repo:
        raise FileNotFoundError(
            f"model folder not found: {text} (the embedded models: {', '.join(EMBEDDED_MODELS)}; "
            "or a folder, or a Hugging Face repo id owner/name)"
        )
    from huggingface_hub import snapshot_download

    offline = None if local_files_only else hub_unreachable()
    if offline is not None:  # the cache only, rather than minutes of retries
        try:
            return Path(
                snapshot_download(
                    repo_id=text, allow_patterns=HUB_PATTERNS, revision=revision, local_files_only=True, token=token
                )
            )
        except Exception:
            raise FileNotFoundError(
                f"model {text!r}: not a local folder, not in the Hugging Face cache, and {offline}"
            ) from None
    try:
        return Path(
            snapshot_download(
                repo_id=text,
                allow_patterns=HUB_PATTERNS,
                revision=revision,
                local_files_only=local_files_only,
                token=token,
            )
        )
    except Exception as e:  # network, auth, or unknown repo: say which id failed and why
        raise FileNotFoundError(
            f"model {text!r}: not a local folder, and downloading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now (its host does not resolve or answer within
    `timeout` seconds), or None where it can: asked once before a download, so that an offline
    machine fails in seconds instead of retrying for minutes. `HF_HUB_OFFLINE=1` says it outright."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"the hub ({url.hostname}) cannot be reached ({e.strerror or type(e).__name__}): offline?"
    return None


def read_config(folder: Path) -> dict:
    """config.json, with the special token ids it leaves out taken from the folder's tokenizer
    (`special_ids_from_tokenizer`)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (every checkpoint folder needs config.json)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return special_ids_from_tokenizer(config, folder, str(path))


def special_ids_from_tokenizer(config: dict, folder: Path, where: str) -> dict:
    """A special id config.json does not state (the published Fast-dLLM v2 and LLaDA2 configs
    state no `mask_token_id`) is the id of the family's token for it (`Family.special_tokens`,
    e.g. `|<MASK>|`) in the folder's tokenizer, never a bare published id: that id is right only
    for the published vocabulary. A folder without a tokenizer keeps the family's default. A
    tokenizer without the token is an error naming the token looked for."""
    family = family_of(config, where)
    missing = {
        name: text
        for name, text in family.special_tokens.items()
        if not any(config.get(key) for key in family.fields[name].read)
    }
    if not missing or not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        return config
    tokenizer = load_tokenizer(folder)
    config = dict(config)
    for name, text in missing.items():
        found = tokenizer.token_to_id(text)
        if found is None:
            default = family.fields[name].default
            there = tokenizer.fast.id_to_token(default) if isinstance(default, int) else None
            raise ValueError(
                f"{where}: {name} is not set and the tokenizer has no {text!r} token to take it from "
                f"(the published id {default} is {there!r} in this vocabulary); set {name} in "
                f"config.json"
            )
        config[family.fields[name].read[0]] = found
    return config


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: malformed ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
                raise ValueError(f"{folder}: only pickle weights (.bin/.pt) found; fastdllm reads safetensors only")
            raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: weight shard listed in the index is missing")
    return files


def checkpoint_dtype(config: dict) -> torch.dtype:
    """The dtype a config.json says its weights are in (`torch_dtype`; transformers 5 writes
    `dtype`), float32 where it says none."""
    return DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), torch.float32)


def _quantize_loaded(model, source, bits: int, group_size: int | None, quantize_head: bool, device) -> None:
    """`load(quantize=...)`: the loaded model's linear layers as int8/int4 ones on `device`; a GGUF
    whose layers are all stored in that width's block format (Q8_0, Q4_0) gives its blocks as they
    are (`gguf.quantized_weights`)."""
    from ..quant import install, quantize_weights
    from .gguf import is_gguf, quantized_weights

    if model.quantization is not None:
        raise ValueError(
            f"quantize: {source} is already quantized ({model.quantization['format']}, "
            f"{model.quantization['bits'][0]}-bit); load it without quantize"
        )
    blocks = quantized_weights(Path(source), model, bits, quantize_head) if is_gguf(source) else None
    if blocks is not None and group_size not in (None, 32):
        raise ValueError(f"group_size: a GGUF's {('Q4_0', 'Q8_0')[bits == 8]} blocks are groups of 32")
    install(model, blocks or quantize_weights(model, bits, group_size, quantize_head), device=device)
    model.to(device)
    model.setup_rope(device)


def _check_mask_token(config: dict, tokenizer: Tokenizer, where: str) -> None:
    family = family_of(config, where)
    mask_id = family.args_from_config(config, where).mask_token_id
    if mask_id >= tokenizer.vocab_size or tokenizer.fast.id_to_token(mask_id) is None:
        raise ValueError(
            f"{where}: mask_token_id {mask_id} is not a token of the tokenizer "
            f"(vocabulary of {tokenizer.vocab_size}; {family.name} masks with "
            f"{family.special_tokens.get('mask_token_id')!r})"
        )


def load_gguf(path: Path, dtype=None, device="cpu") -> tuple[Transformer, Tokenizer]:
    """A GGUF file's model and tokenizer (`models.gguf`): its tensors dequantized into the family's
    model, in `dtype` ("auto": the file's float type where the device computes it natively)."""
    from . import gguf

    f = gguf.GGUFFile(path)
    _, args, config = gguf.read_config(f)
    where = f"{path} (general.architecture {f.arch})"
    tokenizer = gguf.read_tokenizer(f)
    _check_mask_token(config, tokenizer, where)
    model = build_model(config, where)
    wanted = resolve_dtype(dtype)
    if wanted is None:
        wanted, model.dtype_note = auto_dtype(gguf.file_dtype(f), device)
    state = gguf.read_state(f, args, wanted)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        wrong = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        raise ValueError(f"{where}: tensors do not match the model its metadata describes: {wrong[:5]}")
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    model.setup_rope(torch.device(device))
    return model.eval().requires_grad_(False), tokenizer


def build_model(config: dict, where: str = "config.json", device="meta") -> Transformer:
    family = family_of(config, where)
    args = family.args_from_config(config, where)
    with torch.device(device):
        model = (family.model_class or Transformer)(args, family=family, config=config)
    return model


class CheckpointTensors:
    """The tensors of a checkpoint's safetensors files by name, each file opened once."""

    def __init__(self, files: list[Path]):
        self._handles, self._file = {}, {}
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            self._handles[f] = handle
            self._file.update({name: f for name in handle.keys()})

    def names(self) -> set[str]:
        return set(self._file)

    def has(self, name: str) -> bool:
        return name in self._file

    def file(self, name: str) -> Path:
        return self._file[name]

    def get(self, name: str, cut=None) -> torch.Tensor:
        """The tensor, or only the part `cut` names (`tp.Cut`: its rows or columns), read alone."""
        if name not in self._file:
            raise ValueError(f"tensor {name} is missing from the safetensors files")
        if cut is None:
            return self._handles[self._file[name]].get_tensor(name)
        whole = self._handles[self._file[name]].get_slice(name)
        dim, segments = cut
        parts = [whole[(slice(None),) * dim + (slice(a, b),)] for a, b in segments]
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file[name]].get_slice(name).get_shape())


def load_model(
    folder: str | Path,
    dtype=None,
    device="cpu",
    tp: tuple[int, int] | None = None,
    ep: int = 1,
    ep_dispatch: str = "all-reduce",
) -> Transformer:
    """The model of a checkpoint folder; a quantized checkpoint (compressed-tensors, GPTQ:
    `quant.formats`) loads its quantized layers as `QuantizedLinear`s (a quantized routed expert
    is dequantized into its stack). `tp` (rank, world): that rank's part of the model under tensor
    parallelism (`models.tp`), read alone from the files; `ep` (1 or world): whole routed experts
    per rank (expert parallelism), their tokens reached by `ep_dispatch`."""
    from ..quant import install
    from ..quant.formats import read_quant_format
    from . import tp as tensor_parallel

    folder = Path(folder)
    config = read_config(folder)
    where = str(folder / "config.json")
    model = build_model(config, where)
    fmt = read_quant_format(folder, config)
    parts: dict = {}
    if ep > 1 and fmt is not None:
        raise ValueError("ep: a quantized checkpoint's experts are split by tensor parallelism only (use ep=1)")
    if tp is not None and tp[1] > 1:
        parts = tensor_parallel.cuts_of(model, *tp, ep)
        tensor_parallel.apply(model, *tp, ep=ep, dispatch=ep_dispatch)  # on the meta device: shapes, hooks
    dtype = resolve_dtype(dtype)
    if dtype is None:
        dtype, model.dtype_note = auto_dtype(checkpoint_dtype(config), device)
    state, layers = _read_weights(model, folder, fmt, dtype, device, parts)
    if layers:  # the quantized layers replace their linear ones, with the checkpoint's biases
        biases = {name: state.pop(f"{name}.bias", None) for name in layers}
        install(model, layers, device=torch.device(device), dtype=dtype, biases=biases)
        model.quantization.update(format=fmt.method)
    result = model.load_state_dict(state, strict=False, assign=True)
    held = {f"{name}." for name in layers}
    lost = [k for k in result.missing_keys if not k.startswith(tuple(held))]
    if lost or result.unexpected_keys:
        raise ValueError(
            f"{folder}: weights do not match the model: missing {lost[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    model.setup_rope(torch.device(device))
    if getattr(model, "vision", None) is not None:  # its image processor's settings, where saved
        model.vision.a = model.vision.a.with_processor(folder)
    return model.eval().requires_grad_(False)


def _read_weights(model, folder: Path, fmt, dtype, device, parts: dict) -> tuple[dict, dict]:
    """(state dict, quantized layers) of `model` from the folder's safetensors, checked against
    the shapes config.json implies; `parts`: each tensor's cut for a tensor-parallel rank."""
    from ..quant.formats import decode, is_quantized

    where = str(folder / "config.json")
    tensors = CheckpointTensors(weight_files(folder))
    present = tensors.names()
    model.family.fit_to_checkpoint(model, present)
    names = model.family.weight_names(model.args)  # ours -> theirs (a tuple: one tensor per expert)
    expected = {k: v.shape for k, v in model.state_dict().items()}

    def quantized(theirs: str) -> bool:
        return fmt is not None and theirs.endswith(".weight") and is_quantized(fmt, present, theirs[: -len(".weight")])

    def read(theirs: str, want: tuple, cut=None) -> torch.Tensor:
        if quantized(theirs):
            # a quantized layer's packing does not split on file offsets: read whole, then cut
            qw = decode(fmt, tensors.get, theirs[: -len(".weight")], tensors.has)
            if cut is not None:
                qw = qw.cut(*cut)
            if qw.shape != want:
                raise ValueError(f"{theirs}: quantized weight of shape {qw.shape}, but {where} implies {want}")
            return qw
        tensor = tensors.get(theirs, cut)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"{tensors.file(theirs).name}: tensor {theirs} has shape {tuple(tensor.shape)}, "
                f"but {folder.name}/config.json implies {want}"
            )
        return tensor

    state, layers, missing = {}, {}, []
    for ours, theirs in names.items():
        if isinstance(theirs, tuple):  # the experts' stack, filled one expert at a time
            lost = [t for t in theirs if t not in present and not quantized(t)]
            if lost:
                missing += lost
                continue
            stack = torch.empty(expected[ours], dtype=dtype, device=device)
            cut = parts.get(ours)
            held = list(theirs)
            per_expert = None
            if cut is not None and cut[0] == 0:  # expert parallelism: whole experts, the rank's alone
                held = [name for a, b in cut[1] for name in theirs[a:b]]
            elif cut is not None:
                per_expert = (cut[0] - 1, cut[1])
            for e, name in enumerate(held):
                w = read(name, tuple(expected[ours][1:]), per_expert)
                stack[e].copy_(w if isinstance(w, torch.Tensor) else w.dequantize(dtype))
            state[ours] = stack
        elif theirs not in present and (one_by_one := model.family.experts_one_by_one(theirs, model.args)):
            if parts.get(ours) is not None:
                raise ValueError(f"tp: {folder} stores its experts one by one, which is not split yet (tp=1)")
            lost = [t for names_of in one_by_one for t in names_of if t not in present and not quantized(t)]
            if lost:
                missing += lost
                continue
            stack = torch.empty(expected[ours], dtype=dtype, device=device)
            for e, names_of in enumerate(one_by_one):
                rows, cols = expected[ours][1] // len(names_of), expected[ours][2]
                pieces = [read(name, (rows, cols)) for name in names_of]
                stack[e].copy_(torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in pieces]))
            state[ours] = stack
        elif theirs in present or quantized(theirs):
            w = read(theirs, tuple(expected[ours]), parts.get(ours))
            if isinstance(w, torch.Tensor):
                state[ours] = w.to(device=device, dtype=dtype)
            else:
                layers[ours[: -len(".weight")]] = w.with_scale_dtype(dtype).to(device)
        else:
            missing.append(theirs)
    if missing:
        raise ValueError(
            f"{folder}: weights missing from the safetensors files: {', '.join(missing[:5])}"
            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        )
    return state, layers


def check_device(device) -> torch.device:
    """The device to load onto (None: CUDA when available, else CPU); a ValueError naming the
    parameter for a device string torch does not know or a device this torch cannot use."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    backend = getattr(torch, dev.type, None) if dev.type != "cpu" else None
    if dev.type != "cpu":
        available = backend is not None and hasattr(backend, "is_available") and backend.is_available()
        if not available:
            raise ValueError(f"device: {dev.type} is not available in this torch build/machine (use cpu)")
        count = backend.device_count() if hasattr(backend, "device_count") else 1
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device: {device} does not exist ({count} {dev.type} device(s))")
    return dev


QUANTIZE = {"int8": 8, "int4": 4}


def load(
    path_or_repo_id: str | os.PathLike | None = None,
    dtype=None,
    device=None,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    quantize: str | None = None,
    group_size: int | None = None,
    quantize_head: bool = False,
    tp: tuple[int, int] | None = None,
    ep: int = 1,
    ep_dispatch: str = "all-reduce",
    adapters: list[str | os.PathLike] | None = None,
    lora_modules: dict[str, str | os.PathLike] | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer from a folder or hub id; with no argument, the embedded model.

    dtype: "auto" (or None): the checkpoint's `torch_dtype` where the device computes it natively,
    float32 on a CPU that emulates it (`auto_dtype`; `model.dtype_note` says why); "float32",
    "bfloat16", "float16" or a torch dtype: that one.
    device: None (CUDA when available, else CPU), or any torch device string.
    revision, local_files_only, token: for a hub id, as huggingface_hub takes them.
    quantize: None, "int8" (per output channel) or "int4" (groups of `group_size` input columns,
    default 128 or the largest of 64 / 32 that fits the model): weight-only quantization of the
    linear layers at load (`fastdllm.quant`); `quantize_head` includes the output head. A checkpoint
    that is already quantized (compressed-tensors, GPTQ) loads quantized without it.
    tp: (rank, world) under tensor parallelism: that rank's part of the model, read alone from the
    files (`fastdllm.models.tp`; torchrun starts the ranks, `tp.init` joins them). ep: 1, or the
    number of ranks for expert parallelism (each rank holds E / ep whole routed experts; a model
    with experts), their tokens dispatched by `ep_dispatch` ("all-reduce" or "all-to-all").
    adapters: PEFT LoRA adapter folders merged into the weights at load, in order
    (`models.lora`: W += scale * B @ A, as PEFT's merge_and_unload), before any `quantize`.
    lora_modules: {name: folder} of PEFT LoRA adapters kept beside the weights (after any
    `quantize`, over the quantized layers), each row choosing one by name
    (`GenerationConfig.adapter`): rows with different adapters decode in one batch
    (`models.lora.LoRAAdapters`). The adapters a family's checkpoints ship in folders of their
    own (`Family.bundled_adapters`: Nemotron-Labs-Diffusion's `linear_spec_lora`) load so too,
    by the folder's name.
    """
    device = check_device(device)
    split = tp is not None and tp[1] > 1
    if quantize is not None and split:
        raise ValueError(
            "tp: quantize in memory is not split; write a quantized checkpoint (fastdllm quantize) and load it with tp"
        )
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize: {quantize!r} is not one of {', '.join(QUANTIZE)}")
    if quantize is None and (group_size is not None or quantize_head):
        raise ValueError(f"{'group_size' if group_size is not None else 'quantize_head'}: only with quantize")
    if ep != 1 and (tp is None or ep != tp[1]):
        raise ValueError(f"ep: must be 1 or the number of tensor-parallel ranks ({1 if tp is None else tp[1]})")
    from .gguf import is_gguf

    if is_gguf(path_or_repo_id):
        if split:
            raise ValueError("tp: not with a GGUF file (convert it: load it and save_pretrained, then split that)")
        model, tokenizer = load_gguf(Path(path_or_repo_id), dtype=dtype, device="cpu" if quantize else device)
        folder = Path(path_or_repo_id).parent
    else:
        folder = resolve_model_path(path_or_repo_id, revision=revision, local_files_only=local_files_only, token=token)
        if path_or_repo_id is None and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"the embedded default model is missing from the package ({folder})")
        config = read_config(folder)
        tokenizer = load_tokenizer(folder)
        _check_mask_token(config, tokenizer, str(folder / "config.json"))
        model = load_model(
            folder, dtype=dtype, device="cpu" if quantize else device, tp=tp, ep=ep, ep_dispatch=ep_dispatch
        )
    if adapters:
        from .lora import merge_adapter

        if split:
            raise ValueError("adapters: not with tensor parallelism (each rank holds part of each weight)")
        for adapter in adapters:
            merge_adapter(model, adapter)
    if quantize:
        _quantize_loaded(model, path_or_repo_id, QUANTIZE[quantize], group_size, quantize_head, device)
    bundled = {
        name: folder / name
        for name in getattr(model.family, "bundled_adapters", ())
        if (folder / name / "adapter_config.json").is_file() and name not in (lora_modules or {}) and not split
    }
    if lora_modules or bundled:
        from .lora import attach_adapters

        if split and lora_modules:
            raise ValueError("lora_modules: not with tensor parallelism (each rank holds part of each weight)")
        attach_adapters(model, {**bundled, **(lora_modules or {})})
    gen_path = folder / "generation_config.json"
    if gen_path.is_file() and not is_gguf(path_or_repo_id):
        try:
            model.generation_config = json.loads(gen_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen_path}: not valid JSON ({e})") from None
    model.stop_token_ids = stop_ids_of(model, tokenizer)
    model.end_think_token_id = tokenizer.token_to_id("</think>")
    model.name_or_path = str(path_or_repo_id) if path_or_repo_id is not None else "fastdllm/llada-arith"
    model.decoding = recognized_decoding(model.name_or_path, model.config) or model.decoding
    return model, tokenizer


# Checkpoints trained for a decoder of their own, recognised by the name they go by (a hub id, a
# folder, or config.json's `_name_or_path`): their published decoding is the default for them.
DECODING_BY_NAME = {
    "dparallel": "dparallel",
    "d3llm": "d3llm",
    "dmax": "dmax",
    "diffucoder": "diffucoder",
    "dream-coder": "dream-coder",
}


def recognized_decoding(name_or_path: str, config: dict) -> str | None:
    """The preset (`config.PRESETS`) a checkpoint's name says it was trained for, or None."""
    names = " ".join([str(name_or_path), str(config.get("_name_or_path", ""))]).lower()
    return next((preset for key, preset in DECODING_BY_NAME.items() if key in names), None)


def save_pretrained(
    model: Transformer,
    folder: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    dtype=None,
    max_shard_bytes: int | None = None,
    extra_config: dict | None = None,
    quantized: dict | None = None,
    quant_format: str = "compressed-tensors",
    remote_code: bool = True,
) -> Path:
    """Write `model` in its family's real layout: config.json, safetensors (sharded with an index
    when larger than `max_shard_bytes`), and the tokenizer files.

    `remote_code=False` leaves out config.json's `auto_map` (the family's modeling files, which a
    real checkpoint ships beside it): a folder without those files then loads in transformers
    (`AutoTokenizer`) without asking to trust remote code.

    `quantized` (our layer name -> `quant.QuantizedWeight`, from `quant.quantize_weights`) writes
    those layers quantized in `quant_format` ("compressed-tensors" or "gptq") with its
    `quantization_config` (`quantize_checkpoint` does this from a full-precision checkpoint)."""
    from ..quant import QuantizedLinear

    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError(
            "save_pretrained: this model's layers are quantized in memory; write a quantized "
            "checkpoint from the full-precision one (fastdllm.quant.quantize_checkpoint, "
            "`fastdllm quantize`)"
        )
    quantized = quantized or {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = model.family
    dtype = resolve_dtype(dtype) or model.dtype
    config = family.config_from_args(model.args, getattr(model, "config", None))
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(extra_config or {})
    if not remote_code:
        config.pop("auto_map", None)
    names = family.weight_names(model.args)
    if quantized:
        config["quantization_config"] = _quantization_config(model, quantized, names, quant_format)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(_checkpoint_tensors(model, names, dtype, quantized, quant_format), folder, max_shard_bytes)
    writer, own = family.generation_config, getattr(model, "generation_config", None)
    if writer is not None:  # Dream's loader needs generation_config.json
        (folder / "generation_config.json").write_text(json.dumps(writer(model.args, own), indent=2) + "\n")
    elif own:  # what the checkpoint came with (its own block length, say) goes where it came from
        (folder / "generation_config.json").write_text(json.dumps(own, indent=2) + "\n")
    if getattr(model, "vision", None) is not None:  # its image processor's settings
        (folder / "processor_config.json").write_text(json.dumps(model.vision.a.processor_config(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


def _quantization_config(model, quantized: dict, names: dict, quant_format: str) -> dict:
    """config.json's `quantization_config` for layers quantized with one bit width and group size."""
    from ..quant.formats import quantization_config

    bits = {qw.bits for qw in quantized.values()}
    # One group size for the checkpoint (None: per output channel); a layer whose input width
    # is the group size has one group per channel either way.
    sizes = {qw.group_size for qw in quantized.values()}
    group = None if all(qw.per_channel for qw in quantized.values()) else min(sizes)
    if len(bits) != 1 or any(
        qw.group_size != group and not (group is None and qw.per_channel) for qw in quantized.values()
    ):
        raise ValueError("quantized: one bit width and one group size for the whole checkpoint")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = sorted(
        names[f"{n}.weight"].removesuffix(".weight")
        for n in linears
        if n not in quantized and isinstance(names.get(f"{n}.weight"), str)
    )
    return quantization_config(quant_format, bits.pop(), group, ignore)


def _checkpoint_tensors(model, names: dict, dtype, quantized: dict, quant_format: str) -> dict:
    """The checkpoint's tensors under the family's names: quantized layers encoded, stacked
    experts one tensor each."""
    from ..quant.formats import encode

    tensors = {}
    for layer, qw in quantized.items():
        prefix = names[f"{layer}.weight"].removesuffix(".weight")
        qw = qw.to("cpu")
        qw.scale = qw.scale.to(dtype)
        tensors.update(encode(quant_format, qw, prefix))
    for k, v in model.state_dict().items():
        if k.removesuffix(".weight") in quantized:
            continue
        v = v.detach().to("cpu", dtype)
        if isinstance(names[k], tuple):
            tensors.update({theirs: v[e].clone() for e, theirs in enumerate(names[k])})
        else:
            tensors[names[k]] = v.contiguous()
    return tensors


def write_safetensors(tensors: dict, folder: Path, max_shard_bytes: int | None = None) -> None:
    """One model.safetensors, or shards with model.safetensors.index.json when larger than
    `max_shard_bytes`; stale weight files in `folder` are removed first."""
    for stale in list(folder.glob("*.safetensors")) + list(folder.glob("model.safetensors.index.json")):
        stale.unlink()
    meta = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        _save_file(tensors, folder / "model.safetensors", meta)
        return
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensors[name], size + nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, folder / fname, meta)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save_file(tensors: dict, path: Path, metadata: dict) -> None:
    """safetensors' `save_file`, the file then given the mode the user's umask gives new files
    (safetensors creates it readable by its owner alone)."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def quantize_checkpoint(
    src: str | os.PathLike | None,
    dst: str | os.PathLike,
    bits: int,
    *,
    group_size: int | None = None,
    quant_format: str = "compressed-tensors",
    quantize_head: bool = False,
    dtype=None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write the checkpoint at `src` (a folder, hub id or embedded name) to `dst` with its linear
    layers quantized to `bits` (8 or 4) in `quant_format`: loading `dst` gives the same model, and
    the same logits, as `load(src, quantize=...)` with these settings."""
    from ..quant import quantize_weights
    from ..quant.formats import FORMATS

    if quant_format not in FORMATS:
        raise ValueError(f"format: {quant_format!r} is not one of {', '.join(FORMATS)}")
    if dtype is None:  # the checkpoint's own, whatever this machine computes natively
        dtype = checkpoint_dtype(read_config(resolve_model_path(src)))
    model, tokenizer = load(src, dtype=dtype, device="cpu")
    if model.quantization is not None:
        raise ValueError(f"{src}: already quantized ({model.quantization['format']})")
    weights = quantize_weights(model, bits, group_size, quantize_head)
    return save_pretrained(
        model, dst, tokenizer, quantized=weights, quant_format=quant_format, max_shard_bytes=max_shard_bytes
    )


def stop_ids_of(model, tokenizer) -> list[int]:
    """The model's stop tokens: the tokenizer's (EOS, end of turn), the model's EOS, and every id its
    checkpoint's configs (config.json, generation_config.json) name as `eos_token_id`, one or a list
    (as transformers reads them: generation stops at any), within the vocabulary."""
    ids = set(tokenizer.stop_token_ids()) | {model.args.eos_token_id}
    for cfg in (getattr(model, "config", None) or {}, getattr(model, "generation_config", None) or {}):
        value = cfg.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < model.args.vocab_size:
                ids.add(token)
    return sorted(ids)
