"""PEFT LoRA adapters merged at load (`models.lora`), held to PEFT's own `PeftModel` over
transformers' classes on a tiny checkpoint in Dream's layout (Qwen2's names)."""

from __future__ import annotations

import json

import pytest
import torch

import fastdllm
from fastdllm.quant import quantize_model

from .test_models import _full_mask, qwen2_reference

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def adapter(ref, folder, seed: int, **settings):
    """A PEFT LoRA adapter on `ref`, its B weights random (PEFT starts them at 0), saved by PEFT."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **settings)
    wrapped = peft.get_peft_model(ref, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    wrapped.save_pretrained(folder)
    return wrapped.eval()


@pytest.mark.parametrize("settings", [{}, {"use_rslora": True}])
def test_a_merged_adapter_gives_peft_logits(tiny_dream_dir, tmp_path, settings):
    base, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu")
    wrapped = adapter(qwen2_reference(base, tiny_dream_dir), tmp_path / "lora", seed=1, **settings)
    ours, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu", adapters=[tmp_path / "lora"])
    x = torch.randint(0, 700, (2, 23))
    with torch.no_grad():
        theirs = wrapped(input_ids=x, attention_mask=_full_mask(2, 23)).logits
        unadapted = base(x)
        got = ours(x)
    torch.testing.assert_close(got, theirs, atol=2e-4, rtol=1e-4)
    assert (got - unadapted).abs().max() > 1e-2  # the adapter changed the model
    merged = wrapped.merge_and_unload()  # PEFT's own merge agrees too
    with torch.no_grad():
        torch.testing.assert_close(
            got, merged(input_ids=x, attention_mask=_full_mask(2, 23)).logits, atol=2e-4, rtol=1e-4
        )


def test_what_cannot_be_merged_is_refused(tiny_dream_dir, tmp_path):
    base, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu")
    adapter(qwen2_reference(base, tiny_dream_dir), tmp_path / "dora", seed=2, use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        fastdllm.load(tiny_dream_dir, dtype="float32", adapters=[tmp_path / "dora"])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        fastdllm.load(tiny_dream_dir, dtype="float32", adapters=[tmp_path / "nothing"])
    adapter(qwen2_reference(base, tiny_dream_dir), tmp_path / "lora", seed=3)
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(ValueError, match="bias"):
        fastdllm.load(tiny_dream_dir, dtype="float32", adapters=[tmp_path / "lora"])
    # merged into the float weights first, then quantized at load
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(config))
    quantized, _ = fastdllm.load(tiny_dream_dir, dtype="float32", quantize="int8", adapters=[tmp_path / "lora"])
    merged, _ = fastdllm.load(tiny_dream_dir, dtype="float32", adapters=[tmp_path / "lora"])
    x = torch.randint(0, 700, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(x)
        quantize_model(merged, 8)  # the merged weights, quantized as load quantizes
        assert quantized.quantization is not None
        torch.testing.assert_close(quantized(x), merged(x))
        unmerged, _ = fastdllm.load(tiny_dream_dir, dtype="float32", quantize="int8")
        assert (quantized(x) - want).abs().max() < (unmerged(x) - want).abs().max()


def test_the_cli_merges_lora_and_names_a_missing_adapter(tiny_dream_dir, tmp_path, capsys, monkeypatch):
    from fastdllm.cli import main as cli
    from fastdllm.models import lora

    base, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu")
    adapter(qwen2_reference(base, tiny_dream_dir), tmp_path / "lora", seed=4)
    merged, merge = [], lora.merge_adapter
    monkeypatch.setattr(lora, "merge_adapter", lambda model, path: merged.append(merge(model, path)))
    common = ["generate", "--model", str(tiny_dream_dir), "--raw", "--json", "--gen-length", "32", "hello"]
    assert cli.main(common + ["--lora", str(tmp_path / "lora")]) == 0
    assert merged == [3 * base.args.n_layers]  # q_proj, v_proj and down_proj of every layer
    assert "text" in json.loads(capsys.readouterr().out)
    assert cli.main(common + ["--lora", str(tmp_path / "missing")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
