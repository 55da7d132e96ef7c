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

from .models import Transformer, family_of
from .tokenizer import Tokenizer, load_tokenizer

ASSETS_DIR = Path(__file__).parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "llada-arith"
# Models shipped in the package, loadable by name: the default LLaDA-format model, its Dream-format
# twin and its block-diffusion twin in SDAR's layout (see docs/model-card.md).
EMBEDDED_MODELS = ("llada-arith", "dream-arith", "sdar-arith")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_model_path(path_or_repo_id: str | os.PathLike | None, revision: str | None = None,
                       local_files_only: bool = False, token: str | bool | None = None) -> Path:
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
    looks_like_repo = text.count("/") == 1 and not text.startswith((".", "/", "~")) and not path.exists()
    if not looks_like_repo:
        raise FileNotFoundError(f"model folder not found: {text}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_PATTERNS, revision=revision,
                                      local_files_only=local_files_only, token=token))
    except Exception as e:  # network, auth, or unknown repo: say which id failed and why
        raise FileNotFoundError(
            f"model {text!r}: not a local folder, and downloading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (every checkpoint folder needs config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


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


def build_model(config: dict, where: str = "config.json", device="meta") -> Transformer:
    family = family_of(config, where)
    args = family.args_from_config(config, where)
    with torch.device(device):
        model = Transformer(args, family=family, config=config)
    return model


def load_model(folder: str | Path, dtype=None, device="cpu") -> Transformer:
    folder = Path(folder)
    config = read_config(folder)
    where = str(folder / "config.json")
    model = build_model(config, where)
    dtype = resolve_dtype(dtype) or DTYPES.get(str(config.get("torch_dtype")), torch.float32)
    names = model.family.weight_names(model.args)  # ours -> theirs (a tuple: one tensor per expert)
    ours_by_theirs: dict[str, tuple[str, int | None]] = {}
    for ours, theirs in names.items():
        if isinstance(theirs, tuple):
            ours_by_theirs.update({t: (ours, e) for e, t in enumerate(theirs)})
        else:
            ours_by_theirs[theirs] = (ours, None)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state, filled = {}, {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for theirs in sf.keys():
                if theirs not in ours_by_theirs:
                    continue  # e.g. rotary caches some exporters write; nothing we need
                ours, expert = ours_by_theirs[theirs]
                want = tuple(expected[ours]) if expert is None else tuple(expected[ours][1:])
                tensor = sf.get_tensor(theirs)
                if tuple(tensor.shape) != want:
                    raise ValueError(
                        f"{f.name}: tensor {theirs} has shape {tuple(tensor.shape)}, "
                        f"but {folder.name}/config.json implies {want}"
                    )
                if expert is None:
                    state[ours] = tensor.to(device=device, dtype=dtype)
                    continue
                if ours not in state:  # the experts' stack, filled one expert at a time
                    state[ours] = torch.empty(expected[ours], dtype=dtype, device=device)
                    filled[ours] = set()
                state[ours][expert].copy_(tensor)
                filled[ours].add(expert)
    for ours, got in filled.items():
        lost = [names[ours][e] for e in range(len(names[ours])) if e not in got]
        if lost:
            raise ValueError(f"{folder}: weights missing from the safetensors files: {', '.join(lost[:5])}"
                             + (f" (+{len(lost) - 5} more)" if len(lost) > 5 else ""))
    missing = [names[k] if isinstance(names[k], str) else names[k][0] for k in expected if k not in state]
    if missing:
        raise ValueError(f"{folder}: weights missing from the safetensors files: {', '.join(missing[:5])}"
                         + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=True, assign=True)
    model.setup_rope(torch.device(device))
    return model.eval().requires_grad_(False)


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


def load(path_or_repo_id: str | os.PathLike | None = None, dtype=None, device=None, *, revision: str | None = None,
         local_files_only: bool = False, token: str | bool | None = None) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer from a folder or hub id; with no argument, the embedded model.

    dtype: None (the checkpoint's `torch_dtype`), "float32"/"bfloat16" or a torch dtype.
    device: None (CUDA when available, else CPU), or any torch device string.
    revision, local_files_only, token: for a hub id, as huggingface_hub takes them.
    """
    device = check_device(device)
    folder = resolve_model_path(path_or_repo_id, revision=revision, local_files_only=local_files_only, token=token)
    if path_or_repo_id is None and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from the package ({folder})")
    config = read_config(folder)
    args = family_of(config, str(folder / "config.json")).args_from_config(config, str(folder / "config.json"))
    tokenizer = load_tokenizer(folder)
    mask_id = args.mask_token_id
    if mask_id >= tokenizer.vocab_size or tokenizer.fast.id_to_token(mask_id) is None:
        raise ValueError(
            f"{folder / 'config.json'}: mask_token_id {mask_id} is not a token of the tokenizer "
            f"(vocabulary of {tokenizer.vocab_size})"
        )
    model = load_model(folder, dtype=dtype, device=device)
    model.stop_token_ids = sorted(set(tokenizer.stop_token_ids()) | {model.args.eos_token_id})
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            model.generation_config = json.loads(gen_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen_path}: not valid JSON ({e})") from None
    model.name_or_path = str(path_or_repo_id) if path_or_repo_id is not None else "fastdllm/llada-arith"
    return model, tokenizer


def save_pretrained(
    model: Transformer,
    folder: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    dtype=None,
    max_shard_bytes: int | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write `model` in its family's real layout: config.json, safetensors (sharded with an index
    when larger than `max_shard_bytes`), and the tokenizer files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = model.family
    dtype = resolve_dtype(dtype) or model.dtype
    config = family.config_from_args(model.args, getattr(model, "config", None))
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = family.weight_names(model.args)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu", dtype)
        if isinstance(names[k], tuple):  # stacked experts: one tensor each
            tensors.update({theirs: v[e].clone() for e, theirs in enumerate(names[k])})
        else:
            tensors[names[k]] = v.contiguous()
    for stale in list(folder.glob("*.safetensors")) + list(folder.glob("model.safetensors.index.json")):
        stale.unlink()
    meta = {"format": "pt"}
    if max_shard_bytes is None or sum(t.numel() * t.element_size() for t in tensors.values()) <= max_shard_bytes:
        save_file(tensors, str(folder / "model.safetensors"), metadata=meta)
    else:
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
            save_file(shard, str(folder / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    writer = family.generation_config
    if writer is not None:  # Dream's loader needs generation_config.json
        gen = writer(model.args, getattr(model, "generation_config", None))
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder
