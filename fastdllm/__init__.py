"""fastdllm: fast inference for diffusion language models (LLaDA, Dream, LLaDA-MoE, SDAR / TraDo,
Fast-dLLM v2, LLaDA2.0 / 2.1), after Fast-dLLM.

    import fastdllm
    model, tokenizer = fastdllm.load()            # the embedded default model (or a folder / hub id)
    ids = tokenizer.encode_chat([{"role": "user", "content": "..."}])
    out = fastdllm.generate(model, [ids], config=fastdllm.GenerationConfig(gen_length=128))
    print(tokenizer.decode(out.sequences[0]))
    print(fastdllm.generate_text(model, tokenizer, messages=[{"role": "user", "content": "..."}]).text)
    # a model that reads images (DiffusionGemma): one placeholder per picture, the pictures beside
    # out = fastdllm.generate(model, [ids], images=[["photo.jpg"]])
"""

from importlib import import_module

from .config import ConfigError, GenerationConfig
from .version import __version__  # noqa: F401 - the package's version

# The engine's names load on first use, so that the torch-free parts (the config, the sandbox
# that judged programs run in) import without torch.
_LAZY = {
    "GenerationOutput": "engine.generation",
    "StepEvent": "engine.generation",
    "generate": "engine.generation",
    "iter_generate": "engine.generation",
    "stream_blocks": "engine.generation",
    "DEFAULT_MODEL_DIR": "models.loading",
    "load": "models.loading",
    "save_pretrained": "models.loading",
    "TextOutput": "engine.textgen",
    "generate_text": "engine.textgen",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ConfigError", "GenerationConfig", *_LAZY]
