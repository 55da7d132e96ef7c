"""Model families. Each module maps its checkpoint's config and weight names onto `Transformer`."""

from __future__ import annotations

from types import ModuleType

from . import dream, llada
from .transformer import ModelArgs, Transformer

FAMILIES: dict[str, ModuleType] = {llada.MODEL_TYPE: llada, dream.MODEL_TYPE: dream}


def family_of(config: dict, where: str = "config.json") -> ModuleType:
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: unknown model_type {config.get('model_type')!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "ModelArgs", "Transformer", "family_of", "llada", "dream"]
