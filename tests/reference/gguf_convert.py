"""Run llama.cpp's `convert_hf_to_gguf.py` on a checkpoint folder, in an interpreter with what it
pins (torch, transformers, sentencepiece, its own gguf-py). argv: the llama.cpp source (as the
llama-cpp-python source distribution on PyPI ships it under vendor/llama.cpp), the folder, the
outtype (f32, f16, bf16, q8_0), the file to write.

The converter names a BPE tokenizer's pre-tokenizer by a hash of how it encodes a test text, known
only for published vocabularies (`get_vocab_base_pre`; `convert_hf_to_gguf_update.py` adds new
ones). Ours splits text with GPT-2's byte-level regex, so it is told "gpt-2", the name llama.cpp
gives that regex; everything else runs as published."""

import runpy
import sys

llama_cpp, folder, outtype, outfile = sys.argv[1:5]
sys.path.insert(0, llama_cpp)

from conversion import base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile]
runpy.run_path(f"{llama_cpp}/convert_hf_to_gguf.py", run_name="__main__")
