"""Peak memory and weight bytes per rank when a model is loaded split over torchrun's ranks.

    python benchmarks/tp_loading.py [--dim 1024 --layers 8 --hidden 4096] [--ranks 2] [--out FILE]

Writes a random LLaDA-layout checkpoint of that size (bf16) to a temporary folder, then loads it
in one process, and under `torchrun --nproc-per-node N` with `load(..., tp=(rank, N))` (each rank
reads only its parts from the safetensors); each process reports its weight bytes and its peak
resident memory (VmHWM, reset when the process starts) after loading, and before it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _peak_kib() -> int:
    """This process's peak resident memory (VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(folder: str, out: str) -> None:
    """In one process (a rank, under torchrun): load, then write this process's figures."""
    import torch

    import fastdllm  # noqa: F401
    from fastdllm.models import tp

    # the peak so far is the forking parent's (it is kept across exec): start this process's own
    Path("/proc/self/clear_refs").write_text("5")
    base = _peak_kib()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, world = tp.init(world) if world > 1 else (0, 1)
    from fastdllm.models.loading import load_model

    model = load_model(folder, dtype=torch.bfloat16, tp=(rank, world))
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    peak = _peak_kib()
    Path(f"{out}.{rank}").write_text(
        json.dumps(
            {"rank": rank, "world": world, "weight_bytes": weights, "peak_rss_kib": peak, "rss_before_load_kib": base}
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--measure", nargs=2, metavar=("FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        measure(*args.measure)
        return 0
    import torch

    from fastdllm.embedded.recipe import build_tokenizer, new_model
    from fastdllm.models.loading import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer()
        model = new_model(
            "llada",
            "micro",
            tok,
            dim=args.dim,
            n_layers=args.layers,
            n_heads=args.dim // 64,
            n_kv_heads=args.dim // 64,
            hidden_dim=args.hidden,
        )
        folder = save_pretrained(model.to(torch.bfloat16), Path(tmp) / "ckpt", tok, dtype=torch.bfloat16)
        del model
        out = str(Path(tmp) / "figures")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        me = [str(Path(__file__).resolve()), "--measure", str(folder), out]
        subprocess.run([sys.executable, *me], check=True, env=env)
        one = json.loads(Path(f"{out}.0").read_text())
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(args.ranks),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *me,
            ],
            check=True,
            env=env,
        )
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.ranks)]
    mib = 1024
    print(
        f"one process: weights {one['weight_bytes'] / 2**20:.0f} MiB, peak RSS {one['peak_rss_kib'] / mib:.0f} "
        f"MiB ({one['rss_before_load_kib'] / mib:.0f} MiB before loading)"
    )
    for r in ranks:
        print(
            f"rank {r['rank']} of {r['world']}: weights {r['weight_bytes'] / 2**20:.0f} MiB, peak RSS "
            f"{r['peak_rss_kib'] / mib:.0f} MiB ({r['rss_before_load_kib'] / mib:.0f} MiB before loading)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": vars(args), "one_process": one, "ranks": ranks}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
