"""Run llama.cpp's `convert_hf_to_gguf.py` on a checkpoint folder, in an interpreter with what it
pins (torch, transformers, sentencepiece, its own gguf-py). argv: the llama.cpp source (as the
llama-cpp-python source distribution on PyPI ships it under vendor/llama.cpp), the folder, the
outtype (f32, f16, bf16, q8_0), the file to write.

The converter names a BPE tokenizer's pre-tokenizer by a hash of how it encodes a test text, known
only for published vocabularies (`get_vocab_base_pre`; `convert_hf_to_gguf_update.py` adds new
ones). Ours splits text with GPT-2's byte-level regex, so it is told "gpt-2", the name llama.cpp
gives that regex. Its RND1 converter is registered under the architecture "RND1" where RND1's
config says "RND1LM": a copy of the folder says "RND1". Everything else runs as published."""

import json
import runpy
import shutil
import sys
import tempfile

llama_cpp, folder, outtype, outfile = sys.argv[1:5]
sys.path.insert(0, llama_cpp)

from conversion import base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
config = json.load(open(f"{folder}/config.json"))
if config.get("architectures") == ["RND1LM"]:  # its converter registers RND1 under "RND1"
    folder = shutil.copytree(folder, f"{tempfile.mkdtemp()}/rnd1")
    json.dump({**config, "architectures": ["RND1"]}, open(f"{folder}/config.json", "w"))
sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile]
runpy.run_path(f"{llama_cpp}/convert_hf_to_gguf.py", run_name="__main__")
