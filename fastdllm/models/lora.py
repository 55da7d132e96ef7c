"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), merged
into the model's weights at load: W += scale * B @ A, with scale = lora_alpha / r (lora_alpha /
sqrt(r) with `use_rslora`), as PEFT's `merge_and_unload` does, so an adapted model decodes at the
base model's speed.

An adapter's tensors are named as PEFT saves them, after the checkpoint's own module names
(`base_model.model.<module>.lora_A.weight`); they are mapped to ours through the family's
weight names, so an adapter trained on the published checkpoint (LLaDA's, Dream's, ...) applies
as it is. Refused, each with an error that names it: DoRA (`use_dora`), a bias the adapter
trains, `fan_in_fan_out`, per-module ranks or alphas, a module that is not a linear weight of ours
(an embedding, a stacked expert), and a quantized base (merging needs float weights).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."


def read_adapter(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter folder's config and tensors, checked against what merging supports."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_path, weights_path):
        if not f.is_file():
            raise FileNotFoundError(
                f"{f}: missing (a PEFT LoRA adapter is adapter_config.json + adapter_model.safetensors)"
            )
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type {config.get('peft_type')!r}: only LoRA adapters load")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "rank_pattern": "per-module ranks are not supported",
        "alpha_pattern": "per-module alphas are not supported",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise ValueError(f"{config_path}: {key}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{config_path}: bias {config['bias']!r}: adapters that train biases are not supported")
    return config, load_file(str(weights_path))


def merge_adapter(model, path: str | os.PathLike) -> int:
    """Merge the LoRA adapter at `path` into `model`'s weights in place; returns the layers changed."""
    config, tensors = read_adapter(path)
    if getattr(model, "quantization", None) is not None:
        raise ValueError("adapters: the base model is quantized; merge the adapter into float weights, then quantize")
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    ours = {theirs: name for name, theirs in model.family.weight_names(model.args).items() if isinstance(theirs, str)}
    params = dict(model.named_parameters())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"{path}: {key}: not a LoRA A or B weight")
        pairs.setdefault(module, {})[part[0]] = value
    with torch.no_grad():
        for module, ab in pairs.items():
            name = ours.get(f"{module}.weight")
            if name is None or name not in params or set(ab) != {"A", "B"}:
                raise ValueError(f"{path}: {module}: not a linear layer of this {model.family.name} model")
            weight = params[name]
            delta = ab["B"].float() @ ab["A"].float()
            if delta.shape != weight.shape:
                raise ValueError(
                    f"{path}: {module}: the adapter's {tuple(delta.shape)} does not fit {tuple(weight.shape)}"
                )
            weight.copy_((weight.float() + scale * delta.to(weight.device)).to(weight.dtype))
    model._compiled_layers = None  # compiled layers closed over the old weights
    return len(pairs)
