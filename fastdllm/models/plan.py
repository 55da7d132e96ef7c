"""Memory planning from config.json alone: what one rank holds when a model is split over devices.

`plan(config, tp=N, ep=M, ...)` builds the model the loader would build, on the meta device (no
weights are read, nothing is allocated), and sorts every parameter by how tensor and expert
parallelism split it, in gpt-fast's layout:

- *column-parallel* (split by output rows: q/k/v by heads, the MLPs' gate and up) and
  *row-parallel* (split by input columns: the attention output, the MLPs' down projection): 1/tp
  of it per rank. With fewer kv heads than ranks, each rank keeps the one kv head its q heads use
  (kv heads replicated, as GQA under tensor parallelism must);
- routed experts: with `ep` ranks per expert group, each rank holds E/ep experts, each of those
  split 1/(tp/ep) by the tensor-parallel ranks that share it;
- *replicated*: embeddings, norms, routers and the output head (unless `vocab_parallel`, which
  splits the embedding and head by vocabulary rows).

Weight-only int8 / int4 (`quantize`) store the linear layers' weights in 1 byte / half a byte per
parameter, plus one bf16 scale per output row (int8) or a bf16 scale and zero per group of
`group_size` inputs (int4); the embedding, norms and routers stay in `dtype`, and the head too
unless `quantize_head`. The KV cache per rank holds the rank's kv heads for `batch` rows of
`max_len` positions in every layer, in `dtype`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .loading import EMBEDDED_MODELS, build_model, hub_unreachable, read_config, resolve_model_path
from .tp import apply, check_split, cuts_of

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class RankPlan:
    """What one rank holds (bytes), and the whole model's parameter count."""

    parameters: int  # the whole model's
    # per token: every dense weight, the shared expert and the chosen routed ones (no vision tower)
    active_parameters: int
    sharded_bytes: int  # this rank's part of the split layers
    replicated_bytes: int  # what every rank holds whole
    kv_cache_bytes: int
    tp: int
    ep: int

    @property
    def weight_bytes(self) -> int:
        return self.sharded_bytes + self.replicated_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes


STORED_FLOATING = ("fp8", "nvfp4")  # formats only a checkpoint brings (`quant.floating`)


def _linear_bytes(numel: int, rows: int, quantize: str | None, group_size: int, dtype_bytes: int) -> float:
    if quantize == "int8":
        return numel + rows * 2
    if quantize == "fp8":  # an FP8 checkpoint's layers: a byte a weight, a 2-byte scale per row at most
        return numel + rows * 2
    if quantize == "nvfp4":  # half a byte a weight, a 1-byte scale per 16, a float32 global scale
        return numel / 2 + numel / 16 + 4
    if quantize == "int4":
        return numel / 2 + numel / group_size * 4
    return numel * dtype_bytes


def plan(
    config: dict,
    tp: int = 1,
    ep: int = 1,
    *,
    dtype: str = "bfloat16",
    quantize: str | None = None,
    group_size: int = 128,
    quantize_head: bool = False,
    vocab_parallel: bool = False,
    batch: int = 1,
    max_len: int | None = None,
) -> RankPlan:
    """The plan of one rank (see the module docstring) for the model `config` describes."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPE_BYTES)} (got {dtype!r})")
    if quantize not in (None, "int8", "int4", "fp8", "nvfp4"):
        raise ValueError(f"quantize: must be int8, int4, fp8 or nvfp4 (got {quantize!r})")
    model = build_model(config, device="meta")
    args = model.args
    check_split(args, tp, ep)
    parts = cuts_of(model, 0, tp)  # what tensor parallelism splits, exactly as `tp.apply` splits it
    size = DTYPE_BYTES[dtype]
    max_len = args.max_seq_len if max_len is None else max_len
    sharded = replicated = 0.0
    total = active = 0
    for name, p in model.named_parameters():
        numel = p.numel()
        total += numel
        if name.startswith("vision."):  # a vision tower: whole on every rank, run per image, not per token
            replicated += numel * size
            continue
        routed = p.dim() == 3  # routed experts (E, out, in): the only stacked parameters
        active += numel // args.n_experts * args.n_active_experts if routed else numel
        if name in parts:
            dim, segments = parts[name]
            shape = list(p.shape)
            shape[dim] = sum(b - a for a, b in segments)
            rows = shape[0] if p.dim() <= 2 else shape[0] * shape[1]  # output rows (each expert's)
            # a stored FP8 / NVFP4 checkpoint's routed experts are dequantized into their stacks at load
            held = None if p.dim() == 1 or (routed and quantize in STORED_FLOATING) else quantize
            sharded += _linear_bytes(math.prod(shape), rows, held, group_size, size)
        elif name in ("tok_embeddings.weight", "output.weight") and vocab_parallel:
            head_q = quantize if name == "output.weight" and quantize_head else None
            sharded += _linear_bytes(numel // tp, p.shape[0] // tp, head_q, group_size, size)
        elif name == "output.weight" and quantize_head:
            replicated += _linear_bytes(numel, p.shape[0], quantize, group_size, size)
        else:
            replicated += numel * size
    # what the pool holds per position and layer on a rank: the model's shapes as `tp.apply` splits them
    layers, kv_heads, kv_width = (apply(model, 0, tp, ep=ep) if tp > 1 else model).kv_shape
    kv = 2 * layers * kv_heads * kv_width * batch * max_len * size
    return RankPlan(total, active, int(sharded), int(replicated), kv, tp, ep)


def config_of(path_or_repo_id: str | None, revision: str | None = None, local_files_only: bool = False) -> dict:
    """config.json alone: of a folder, an embedded model, a .json file, or a hub repo id (only that
    file is downloaded); a GGUF file's, as its family writes it."""
    text = None if path_or_repo_id is None else str(path_or_repo_id)
    from .gguf import config_of_gguf, is_gguf

    if is_gguf(text):  # its metadata and tensor shapes; no tensor is read
        return config_of_gguf(Path(text))
    if text is not None and text.endswith(".json") and Path(text).is_file():
        try:
            return json.loads(Path(text).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{text}: not valid JSON ({e})") from None
    if text is None or text in EMBEDDED_MODELS or Path(text).expanduser().is_dir():
        return read_config(resolve_model_path(text))
    offline = None if local_files_only else hub_unreachable()
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(
            text, "config.json", revision=revision, local_files_only=bool(offline) or local_files_only
        )
    except Exception as e:  # network, auth, or unknown repo: say which id failed and why
        raise FileNotFoundError(
            f"model {text!r}: not a folder, and its config.json could not be had from the hub "
            f"({offline or type(e).__name__})"
        ) from None
    return json.loads(Path(path).read_text())
