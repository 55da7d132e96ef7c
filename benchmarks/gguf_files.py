"""The embedded model as GGUF files: bytes on disk, load time and accuracy, beside its safetensors.

    python benchmarks/gguf_files.py [--model llada-arith] [--limit 500] [--threads 2]
        [--converter LLAMA_CPP --converter-python PY] [--out FILE]

Writes the model with `fastdllm quantize --format gguf`'s writer at F32, F16, Q8_0 and Q4_0 (with
`--converter`, also llama.cpp's own `convert_hf_to_gguf.py` at F32 and Q8_0, from the safetensors
checkpoint), then per file: its size, the median of three loads (`fastdllm.load`, float32), the
weights' bytes in memory, and the accuracy, forwards and tokens/s of `fastdllm eval`'s decoding (the
model's defaults) on the first `--limit` held-out arith problems. Every type is dequantized at
load, but for our Q8_0 and Q4_0 files also loaded with `quantize=` (their blocks held as our int8 /
int4 layers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import fastdllm
from fastdllm.evaluation.harness import evaluate
from fastdllm.models.gguf import write_gguf
from fastdllm.models.loading import save_pretrained
from fastdllm.quant import weight_bytes

CONVERT = Path(__file__).resolve().parent.parent / "tests" / "reference" / "gguf_convert.py"


def measure(path: Path, limit: int, quantize: str | None = None) -> dict:
    files = [path] if path.is_file() else sorted(path.glob("*"))
    size = sum(f.stat().st_size for f in files)
    loads = []
    for _ in range(3):
        started = time.perf_counter()
        model, tok = fastdllm.load(str(path), dtype="float32", quantize=quantize)
        loads.append(time.perf_counter() - started)
    started = time.perf_counter()
    result = evaluate(model, tok, "arith", limit=limit)
    seconds = time.perf_counter() - started
    return {
        "bytes": size,
        "weight_bytes_in_memory": weight_bytes(model)["weight_bytes"],
        "load_s": round(statistics.median(loads), 3),
        "accuracy": result["accuracy"],
        "nfe_per_problem": round(result["nfe_per_sample"], 2),
        "positions_per_token": round(result["positions_per_token"], 2),
        "tokens_per_s": round(result["tokens_per_second"], 1),
        "eval_s": round(seconds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--converter", default=None, help="llama.cpp's source (vendor/llama.cpp)")
    p.add_argument("--converter-python", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = fastdllm.load(a.model, dtype="float32")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = save_pretrained(model, tmp / "safetensors", tok, dtype=torch.float32)
        paths = {"safetensors (float32)": folder}
        for kind in ("f32", "f16", "q8_0", "q4_0"):
            paths[f"ours {kind.upper()}"] = write_gguf(model, tok, tmp / f"ours-{kind}.gguf", kind)
        if a.converter and a.converter_python:
            for kind in ("f32", "q8_0"):
                out = tmp / f"llama.cpp-{kind}.gguf"
                run = subprocess.run(
                    [a.converter_python, str(CONVERT), a.converter, str(folder), kind, str(out)],
                    capture_output=True,
                    text=True,
                )
                assert run.returncode == 0, run.stderr[-2000:]
                paths[f"llama.cpp {kind.upper()}"] = out
        held = {
            "ours Q8_0 held as int8": (paths["ours Q8_0"], "int8"),
            "ours Q4_0 held as int4": (paths["ours Q4_0"], "int4"),
        }
        for name, path in [*paths.items(), *held.items()]:
            path, quantize = path if isinstance(path, tuple) else (path, None)
            results[name] = measure(path, a.limit, quantize)
            r = results[name]
            print(
                f"{name:24s} {r['bytes'] / 2**20:7.2f} MiB  load {r['load_s']:.3f} s  accuracy {r['accuracy']:.3f}  "
                f"{r['nfe_per_problem']} forwards/problem  {r['tokens_per_s']} tok/s"
            )
    summary = {
        "model": a.model or "llada-arith (embedded)",
        "problems": a.limit,
        "threads": a.threads,
        "files": results,
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
