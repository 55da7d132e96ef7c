"""`fastdllm plan`: bytes per rank under tensor / expert parallelism, from config.json alone, on the
published configs each family keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastdllm.models import dream, fast_dllm_v2, llada, llada2, llada_moe, sdar
from fastdllm.models.loading import build_model
from fastdllm.models.plan import plan

DATA = Path(__file__).parent / "data"
# model: (its module, published total parameters in billions, read off the model cards)
PUBLISHED = {
    "LLaDA-8B": (llada, 8.0),
    "Dream-7B": (dream, 7.6),
    "Fast-dLLM-v2-7B": (fast_dllm_v2, 7.6),
    "SDAR-4B": (sdar, 4.4),
    "LLaDA2.0-mini": (llada2, 16.3),
    "LLaDA-MoE-7B-A1B": (llada_moe, 7.4),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_plan_counts_the_model_the_loader_builds(name):
    module, billions = PUBLISHED[name]
    config = module.REFERENCE_CONFIG
    built = sum(p.numel() for p in build_model(config, device="meta").parameters())
    whole = plan(config)
    assert whole.parameters == built and abs(built / 1e9 - billions) < 0.06 * billions
    assert whole.sharded_bytes + whole.replicated_bytes == whole.weight_bytes
    assert whole.weight_bytes == 2 * built  # bfloat16, nothing split
    halves = plan(config, tp=2)
    assert halves.replicated_bytes == whole.replicated_bytes
    assert abs(2 * halves.sharded_bytes - whole.sharded_bytes) <= 16  # the split layers, halved
    assert halves.kv_cache_bytes * 2 == whole.kv_cache_bytes or build_model(config).args.n_kv_heads < 2


def test_kv_heads_are_kept_whole_when_ranks_outnumber_them():
    config = llada2.REFERENCE_CONFIG  # 4 kv heads
    args = build_model(config).args
    assert args.n_kv_heads < 8
    four, eight = plan(config, tp=4, max_len=1024), plan(config, tp=8, max_len=1024)
    assert four.kv_cache_bytes == eight.kv_cache_bytes == 2 * args.n_layers * args.head_dim * 1024 * 2


def test_quantized_and_expert_parallel_plans():
    config = llada2.REFERENCE_CONFIG
    bf16, int4 = plan(config, tp=8), plan(config, tp=8, quantize="int4")
    assert 0.25 < int4.sharded_bytes / bf16.sharded_bytes < 0.3 and int4.replicated_bytes == bf16.replicated_bytes
    assert plan(config, tp=8, ep=8).weight_bytes == bf16.weight_bytes  # the same bytes, other experts
    with pytest.raises(ValueError, match=r"tp: 3 does not divide the 16 attention heads"):
        plan(config, tp=3)
    with pytest.raises(ValueError, match="ep: 3"):
        plan(config, tp=8, ep=3)
    with pytest.raises(ValueError, match="ep: this model has no experts"):
        plan(llada.REFERENCE_CONFIG, tp=2, ep=2)


def test_the_command_says_whether_it_fits(tmp_path, capsys):
    from fastdllm.cli.main import main as cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps(llada.REFERENCE_CONFIG))
    run = ["plan", "--model", str(path), "--tp", "2", "--batch", "8", "--max-len", "2048"]
    assert cli(run + ["--memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "fits 24 GiB: yes" in out and "on this machine --dtype auto loads it in " in out
    assert cli(run + ["--memory", "8", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["tp"] == 2
    assert out["total_bytes_per_rank"] == out["weight_bytes_per_rank"] + out["kv_cache_bytes_per_rank"]
    assert cli(run[:5] + ["--tp", "3"]) == 2
    assert "tp: 3 does not divide" in capsys.readouterr().err


def test_llada2_flash_fits_eight_80_gb_devices_split_either_way():
    """LLaDA2.0-flash's layout (tests/data: LLaDA2.0-mini's config with flash's widths, as recalled;
    the count checks them against the published 100B total / 6.1B active parameters)."""
    config = json.loads((DATA / "llada2.0-flash.config.json").read_text())
    whole = plan(config)
    assert abs(whole.parameters / 1e9 - 100) < 6 and abs(whole.active_parameters / 1e9 - 6.1) < 0.3
    tp8, ep8 = plan(config, tp=8), plan(config, tp=8, ep=8)
    assert tp8.weight_bytes == ep8.weight_bytes < 30 * 2**30  # ~26 GiB of bfloat16 per rank
    assert plan(config).weight_bytes > 80 * 2**30  # and not on one device


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_plan_reports_the_bytes_load_holds_for_every_source(kind, tiny_llada, tokenizer, tmp_path, capsys):
    """One dtype rule: `--dtype auto` (plan's default, as every command's) is the dtype the checkpoint
    stores, a folder's config.json or a GGUF file's matrices, where this machine computes it natively;
    plan's weight bytes are those the loaded model holds."""
    import torch

    import fastdllm
    from fastdllm.cli.main import main as cli
    from fastdllm.models.gguf import write_gguf
    from fastdllm.models.loading import save_pretrained

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[kind]
    folder = save_pretrained(tiny_llada, tmp_path / "folder", tokenizer, dtype=dtype)
    gguf = write_gguf(tiny_llada, tokenizer, tmp_path / f"tiny-{kind}.gguf", kind)
    for source in (folder, gguf):
        model, _ = fastdllm.load(str(source))
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert cli(["plan", "--model", str(source), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["weight_bytes_per_rank"] == held, source


@pytest.mark.parametrize("name", ["llada-fp8", "llada-nvfp4"])
def test_plan_counts_a_float_quantized_checkpoint_as_load_holds_it(name, capsys):
    """FP8 and NVFP4 checkpoints' linear layers stay quantized when loaded: plan counts them so,
    its bytes those the loaded model holds."""
    import fastdllm
    from fastdllm.cli.main import main as cli

    folder = Path(__file__).parent / "fixtures" / "compressed_tensors" / name
    model, _ = fastdllm.load(str(folder))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if not n.endswith(("rope_cos", "rope_sin"))
    )
    assert cli(["plan", "--model", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes_per_rank"] == held
