"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`): merged
into the model's weights at load (`merge_adapter`): W += scale * B @ A, with scale = lora_alpha / r
(lora_alpha / sqrt(r) with `use_rslora`), as PEFT's `merge_and_unload` does, so an adapted model
decodes at the base model's speed; or kept beside them by name (`LoRAAdapters`), so that rows of
different adapters share forwards.

An adapter's tensors are named as PEFT saves them, after the checkpoint's own module names
(`base_model.model.<module>.lora_A.weight`); they are mapped to ours through the family's
weight names, so an adapter trained on the published checkpoint (LLaDA's, Dream's, ...) applies
as it is. Refused, each with an error that names it: DoRA (`use_dora`), a bias the adapter
trains, `fan_in_fan_out`, per-module ranks or alphas, a module that is not a linear weight of ours
(an embedding, a stacked expert), and, for merging, a quantized base (it needs float weights).
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


def scale_of(config: dict) -> float:
    """PEFT's scale of an adapter's delta: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def merge_adapter(model, path: str | os.PathLike) -> int:
    """Merge the LoRA adapter at `path` into `model`'s weights in place; returns the layers changed."""
    config, tensors = read_adapter(path)
    if getattr(model, "quantization", None) is not None:
        raise ValueError("adapters: the base model is quantized; merge the adapter into float weights, then quantize")
    scale, pairs = scale_of(config), _pairs(model, path, tensors)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for module, ab in pairs.items():
            weight = params[f"{module}.weight"]
            delta = ab["B"].float() @ ab["A"].float()
            weight.copy_((weight.float() + scale * delta.to(weight.device)).to(weight.dtype))
    model._compiled_layers = None  # compiled layers closed over the old weights
    return len(pairs)


def _pairs(model, path, tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    """An adapter's A and B per linear module of ours (`layers.0.attention.wq`), float or quantized."""
    ours = {theirs: name for name, theirs in model.family.weight_names(model.args).items() if isinstance(theirs, str)}
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"{path}: {key}: not a LoRA A or B weight")
        name = ours.get(f"{module}.weight", "").removesuffix(".weight")
        if not hasattr(modules.get(name), "in_features"):
            raise ValueError(f"{path}: {module}: not a linear layer of this {model.family.name} model")
        pairs.setdefault(name, {})[part[0]] = value
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {name}: needs both lora_A and lora_B")
        layer = modules[name]
        if (ab["B"].shape[0], ab["A"].shape[1]) != (layer.out_features, layer.in_features):
            raise ValueError(
                f"{path}: {name}: the adapter's shape does not fit ({layer.out_features}, {layer.in_features})"
            )
    return pairs


class LoRAAdapters:
    """Named adapters kept beside the base weights, so that rows decoding with different adapters
    (and the base) share one forward, as vLLM serves `--lora-modules`. Each adapted linear layer
    adds, to the output of each token whose row decodes with adapter k, (x A_k^T) B_k^T scale_k, as
    PEFT's unmerged `LoraLayer` does: a forward hook on the layer, so a quantized layer takes it
    too. The tokens of each adapter present go through two matmuls of their own (plain PyTorch, no
    custom kernel); a forward with no adapter row costs nothing more.

    `model.lora` holds them; `tokens(ids)` sets, for the forwards inside it, each token's adapter."""

    def __init__(self, model):
        self.model = model
        self.names: list[str] = []
        self.paths: list[str] = []
        self.layers: dict[str, dict] = {}  # module -> {adapter index: (A, B, scale)}
        # for the forward running: per adapter present, its tokens' rows (None: every token)
        self.groups: list | None = None
        self._hooks: list = []

    def index(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"adapter: {name!r} is not loaded (loaded: {', '.join(self.names) or 'none'})")
        return self.names.index(name)

    def add(self, name: str, path: str | os.PathLike) -> None:
        """Load the PEFT adapter at `path` under `name` (refusals as `merge_adapter`'s)."""
        if name in self.names:
            raise ValueError(f"adapter: {name!r} is loaded already")
        config, tensors = read_adapter(path)
        scale, pairs = scale_of(config), _pairs(self.model, path, tensors)
        k = len(self.names)
        self.names.append(name)
        self.paths.append(str(path))
        dtype, device = self.model.dtype, self.model.device
        for module, ab in pairs.items():
            self.layers.setdefault(module, {})[k] = (ab["A"].to(device, dtype), ab["B"].to(device, dtype), scale)
        self._install()

    def _install(self) -> None:
        for h in self._hooks:
            h.remove()
        modules = dict(self.model.named_modules())
        self._hooks = [modules[m].register_forward_hook(self._hook(layer)) for m, layer in self.layers.items()]

    def _hook(self, layer: dict):
        def add_deltas(module, inputs, output):
            if self.groups is None:
                return output
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            out = output.reshape(-1, output.shape[-1])
            for k, rows in self.groups:
                if k not in layer:  # this adapter leaves this layer as it is
                    continue
                a, b, scale = layer[k]
                if rows is None:  # every token of the forward
                    out = out + ((x @ a.T) @ b.T * scale).to(out.dtype)
                else:
                    out = out.index_add(0, rows, ((x[rows] @ a.T) @ b.T * scale).to(out.dtype))
            return out.view(output.shape)

        return add_deltas

    class _Tokens:
        def __init__(self, owner, groups):
            self.owner, self.groups = owner, groups

        def __enter__(self):
            self.before, self.owner.groups = self.owner.groups, self.groups

        def __exit__(self, *exc):
            self.owner.groups = self.before

    def tokens(self, runs: int | list[tuple[int, int]] | None):
        """A context in which the forwards' tokens decode with adapters: `runs` is one adapter's index
        (in `names`; -1: the base) for every token, or (index, count) runs in the forward's token
        order. Each adapter's tokens are found here, once per forward, from the runs alone (no read
        of the device), not in every layer."""
        groups = None
        if isinstance(runs, int):
            groups = [(runs, None)] if runs >= 0 else None
        elif runs:
            present = sorted({k for k, n in runs if k >= 0 and n})
            if len(present) == 1 and all(k == present[0] for k, n in runs if n):
                groups = [(present[0], None)]
            elif present:
                starts = [sum(n for _, n in runs[:j]) for j in range(len(runs))]
                device = self.model.device
                groups = [
                    (k, torch.cat([torch.arange(s, s + n, device=device) for (j, n), s in zip(runs, starts) if j == k]))
                    for k in present
                ]
        return self._Tokens(self, groups)


def attach_adapters(model, adapters: dict[str, str | os.PathLike]) -> LoRAAdapters:
    """Load named adapters beside `model`'s weights (`model.lora`); rows choose one by name
    (`GenerationConfig.adapter`)."""
    from .transformer import TransformerBlock

    if not isinstance(model.layers[0], TransformerBlock):
        raise ValueError(f"lora_modules: not yet for {model.family.name} (its layers are not the shared transformer's)")
    lora = getattr(model, "lora", None) or LoRAAdapters(model)
    for name, path in adapters.items():
        lora.add(name, path)
    model.lora = lora
    return lora
