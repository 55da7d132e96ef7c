"""Model families. Each module maps its checkpoint's config and weight names onto `Transformer`."""

from __future__ import annotations

from . import diffusion_gemma, dream, fast_dllm_v2, llada, llada2, llada_moe, nemotron_labs_diffusion, rnd1, sdar, wedlm
from .family import Family
from .transformer import ModelArgs, Transformer

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        llada.FAMILY,
        dream.FAMILY,
        fast_dllm_v2.FAMILY,
        sdar.FAMILY,
        llada2.FAMILY,
        llada_moe.FAMILY,
        rnd1.FAMILY,
        diffusion_gemma.FAMILY,
        wedlm.FAMILY,
        nemotron_labs_diffusion.FAMILY,
    )
}
# Other model_type spellings of a family.
ALIASES = {alias: llada_moe.FAMILY for alias in llada_moe.ALIASES}


def family_of(config: dict, where: str = "config.json") -> Family:
    model_type = str(config.get("model_type", "")).lower()
    if model_type == llada.MODEL_TYPE and llada_moe.is_moe_config(config):
        return llada_moe.FAMILY  # LLaDA-MoE's checkpoints say "llada" too
    if model_type in ALIASES:
        return ALIASES[model_type]
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: unknown model_type {config.get('model_type')!r}; the families we know: "
            + ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES.values())
        )
    return FAMILIES[model_type]


__all__ = [
    "FAMILIES",
    "diffusion_gemma",
    "Family",
    "ModelArgs",
    "Transformer",
    "family_of",
    "llada",
    "dream",
    "fast_dllm_v2",
    "llada2",
    "llada_moe",
    "nemotron_labs_diffusion",
    "rnd1",
    "sdar",
    "wedlm",
]
