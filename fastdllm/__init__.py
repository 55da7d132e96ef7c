"""fastdllm: fast inference for diffusion language models (LLaDA, Dream), after Fast-dLLM.

    import fastdllm
    model, tokenizer = fastdllm.load()            # the embedded default model (or a folder / hub id)
    ids = tokenizer.encode_chat([{"role": "user", "content": "..."}])
    out = fastdllm.generate(model, [ids], config=fastdllm.GenerationConfig(gen_length=128))
    print(tokenizer.decode(out.sequences[0]))
    print(fastdllm.generate_text(model, tokenizer, messages=[{"role": "user", "content": "..."}]).text)
"""

from .config import ConfigError
from .generate import GenerationConfig, GenerationOutput, StepEvent, generate, iter_generate, stream_blocks
from .loading import DEFAULT_MODEL_DIR, load, save_pretrained
from .textgen import TextOutput, generate_text

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GenerationConfig",
    "TextOutput",
    "generate_text",
    "GenerationOutput",
    "StepEvent",
    "generate",
    "iter_generate",
    "stream_blocks",
    "load",
    "save_pretrained",
    "DEFAULT_MODEL_DIR",
]
