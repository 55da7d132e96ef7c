"""Token-for-token agreement with NVlabs/Fast-dLLM's `llada/generate.py`, run by the reference's
own code (its loops and its modeling file) in its own interpreter, on the embedded LLaDA saved in
the real layout. Set FASTDLLM_REFERENCE to a checkout of NVlabs/Fast-dLLM and
FASTDLLM_REFERENCE_PYTHON to an interpreter with what it pins (transformers==4.49.0, einops, torch);
without them the test is skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.loading import save_pretrained
from fastdllm.tasks import get_task

CHECKOUT = os.environ.get("FASTDLLM_REFERENCE")
PYTHON = os.environ.get("FASTDLLM_REFERENCE_PYTHON")
RUNNER = Path(__file__).parent / "reference" / "fast_dllm_llada.py"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (CHECKOUT and PYTHON and Path(CHECKOUT, "llada", "generate.py").exists()),
    reason="set FASTDLLM_REFERENCE (a NVlabs/Fast-dLLM checkout) and FASTDLLM_REFERENCE_PYTHON")]

CONFIGS = [dict(gen_length=gen, block_length=32, steps=steps, cache=cache, threshold=threshold)
           for gen, steps in ((64, 64), (128, 64)) for cache in ("none", "prefix", "dual") for threshold in (None, 0.9)]


def test_the_embedded_llada_decodes_as_the_reference_does(tmp_path):
    model, tok = fastdllm.load()
    folder = save_pretrained(model, tmp_path / "llada", tok, dtype=torch.float32)
    for name in ("configuration_llada.py", "modeling_llada.py"):
        shutil.copy(Path(CHECKOUT, "llada", "model", name), folder / name)
    task = get_task("arith")
    prompts = [task.encode(tok, doc, []) for doc in task.load(limit=3)]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mask_id": model.args.mask_token_id, "prompts": prompts, "configs": CONFIGS}))
    out = subprocess.run([PYTHON, str(RUNNER), CHECKOUT, str(folder), str(job)], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = iter(json.loads(out.stdout.strip().splitlines()[-1])["runs"])
    for c in CONFIGS:
        config = GenerationConfig.fast_dllm(suffix_window=None, refresh="full", stop_at_eos=False, **c)
        for prompt in prompts:
            ref, ours = next(theirs), fastdllm.generate(model, [prompt], config=config)
            assert ours.sequences[0].tolist() == ref["tokens"], (c, prompt)
            # The reference's cached loops run one more forward, revealing nothing, after a block
            # that its block-start forward completed; we stop there (see `fastdllm.decoder`).
            blocks = ours.unmask_step[0].view(-1, c["block_length"])
            finished_at_start = sum(len(set(b.tolist())) == 1 for b in blocks) if c["cache"] != "none" else 0
            assert ref["nfe"] == ours.nfe + finished_at_start, (c, ref["nfe"], ours.nfe)
