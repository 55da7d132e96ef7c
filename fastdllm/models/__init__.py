"""Model families. Each module maps its checkpoint's config and weight names onto `Transformer`."""

from __future__ import annotations

from . import dream, llada
from .family import Family
from .transformer import ModelArgs, Transformer

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llada.FAMILY, dream.FAMILY)}


def family_of(config: dict, where: str = "config.json") -> Family:
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: unknown model_type {config.get('model_type')!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "ModelArgs", "Transformer", "family_of", "llada", "dream"]
