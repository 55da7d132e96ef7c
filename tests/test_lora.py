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


def named_adapters(tiny_dream_dir, tmp_path):
    """Two PEFT adapters of different ranks and targets on the tiny Dream checkpoint (PeftModels
    of each), and our model holding both by name over its weights."""
    base, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu")
    one = adapter(qwen2_reference(base, tiny_dream_dir), tmp_path / "one", seed=1)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "o_proj", "up_proj"], use_rslora=True)
    two = peft.get_peft_model(qwen2_reference(base, tiny_dream_dir), config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in two.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    two.save_pretrained(tmp_path / "two")
    modules = {"one": tmp_path / "one", "two": tmp_path / "two"}
    ours, tok = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu", lora_modules=modules)
    return base, {"one": one, "two": two.eval()}, ours, tok


def test_named_adapters_give_peft_logits_row_by_row(tiny_dream_dir, tmp_path):
    """Unmerged, by name: each row of one forward gives its adapter's PeftModel logits (and the base
    row the base's), as the adapter merged alone does."""
    base, peft_models, ours, _ = named_adapters(tiny_dream_dir, tmp_path)
    x = torch.randint(0, 700, (3, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = ours(x, adapters=["one", None, "two"])
        torch.testing.assert_close(got[1], base(x[1:2])[0])
        for row, name in ((0, "one"), (2, "two")):
            want = peft_models[name](input_ids=x[row : row + 1], attention_mask=_full_mask(1, 19)).logits[0]
            torch.testing.assert_close(got[row], want, atol=2e-4, rtol=1e-4)
            merged, _ = fastdllm.load(tiny_dream_dir, dtype="float32", adapters=[tmp_path / name])
            torch.testing.assert_close(got[row], merged(x[row : row + 1])[0], atol=2e-4, rtol=1e-4)
        assert (got[0] - base(x[:1])[0]).abs().max() > 1e-2


def test_rows_with_different_adapters_decode_in_one_batch_as_alone(tiny_dream_dir, tmp_path):
    from fastdllm.engine.decoder import BlockDecoder

    _, _, ours, tok = named_adapters(tiny_dream_dir, tmp_path)
    base = fastdllm.GenerationConfig(gen_length=16, block_length=8, threshold=0.5, stop_at_eos=False)
    prompts = [tok.encode("Question: 1 + 2?"), tok.encode("Tom has 5 apples"), tok.encode("Question: 1 + 2?")]
    names = ["one", None, "two"]
    decoder = BlockDecoder(ours, base)
    rows = [decoder.add([p], config=base.replace(adapter=n))[0] for p, n in zip(prompts, names)]
    while decoder.active:
        decoder.step()
    alone = [fastdllm.generate(ours, [p], config=base.replace(adapter=n)).sequences[0] for p, n in zip(prompts, names)]
    assert [r.answer.tolist() for r in rows] == [a.tolist() for a in alone]
    assert alone[0].tolist() != alone[2].tolist()  # the same prompt, two adapters, two answers
    with pytest.raises(ValueError, match="^adapter:"):
        fastdllm.generate(ours, [prompts[0]], config=base.replace(adapter="three"))


def test_named_adapters_over_a_quantized_base(tiny_dream_dir, tmp_path):
    """int8 base weights with float adapters: a quantized layer's output plus each token's adapter
    delta, (x A^T) B^T scale, exactly; the model then as far from the float one as the base is."""
    _, _, full, _ = named_adapters(tiny_dream_dir, tmp_path)
    modules = {"one": tmp_path / "one", "two": tmp_path / "two"}  # the same adapters, over int8 weights
    quantized, _ = fastdllm.load(tiny_dream_dir, dtype="float32", quantize="int8", lora_modules=modules)
    assert quantized.quantization is not None
    layer = quantized.layers[0].attention.wq
    a, b, scale = quantized.lora.layers["layers.0.attention.wq"][quantized.lora.index("one")]
    x = torch.randn(1, 5, layer.in_features, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[0, -1, 0, 1, 0]])
    with torch.no_grad():
        plain = layer(x)
        with quantized.lora.tokens([(int(k), 1) for k in ids[0]]):  # runs of one token each
            got = layer(x)
        want = plain.clone()
        rows = ids[0] == quantized.lora.index("one")
        want[0, rows] += (x[0, rows] @ a.T) @ b.T * scale
        torch.testing.assert_close(got, want)  # "two" does not adapt q_proj: its token stays plain
        tokens = torch.randint(0, 700, (2, 12), generator=torch.Generator().manual_seed(4))
        q, f = quantized(tokens, adapters=["one", "two"]), full(tokens, adapters=["one", "two"])
        base_error = (quantized(tokens) - full(tokens)).abs().max()
    assert (q - quantized(tokens)).abs().max() > 1e-2  # the adapters act
    assert (q - f).abs().max() < 2 * base_error


def test_the_server_serves_each_adapter_by_name(tiny_dream_dir, tmp_path):
    """/v1/models lists each adapter (its base as parent, as vLLM's); a request naming one decodes
    with it, as generate does alone, beside a request to the base in the same server; echo scoring
    scores under it; an unknown name is a 404."""
    from tests.test_server import MODEL, LiveServer

    _, _, ours, tok = named_adapters(tiny_dream_dir, tmp_path)
    config = fastdllm.GenerationConfig(gen_length=8, block_length=8, threshold=0.5, stop_at_eos=False)
    server = LiveServer(ours, tok, defaults=config)
    try:
        cards = {c["id"]: c for c in server.client.models.list().model_dump()["data"]}
        assert set(cards) == {MODEL, "one", "two"} and cards["one"]["parent"] == MODEL
        answers = {}
        for name in (MODEL, "one", "two"):
            r = server.post("/v1/completions", {"model": name, "prompt": "Question: 1 + 2?", "max_tokens": 8})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name  # the adapter's name echoed, as vLLM does
            answers[name] = r.json()["choices"][0]["text"]
        chat = {"model": "one", "messages": [{"role": "user", "content": "1 + 2?"}], "max_tokens": 8}
        assert server.post("/v1/chat/completions", chat).json()["model"] == "one"
        streamed = server.post("/v1/chat/completions", {**chat, "stream": True}).text
        assert '"model":"one"' in streamed.replace(" ", "")
        for name in ("one", "two"):
            alone = fastdllm.generate(ours, [tok.encode("Question: 1 + 2?")], config=config.replace(adapter=name))
            assert answers[name] == tok.decode(alone.sequences[0])
        scored = {}
        for name in (MODEL, "one"):
            body = {"model": name, "prompt": "Question: 1 + 2?", "max_tokens": 1, "echo": True, "logprobs": 1}
            r = server.post("/v1/completions", body)
            assert r.status_code == 200, r.text
            scored[name] = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert r.json()["model"] == name
        assert scored[MODEL] != scored["one"]
        r = server.post("/v1/completions", {"model": "three", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    finally:
        server.stop()


def test_the_cli_decodes_with_a_named_adapter(tiny_dream_dir, tmp_path, capsys):
    from fastdllm.cli.main import main as cli

    _, _, ours, tok = named_adapters(tiny_dream_dir, tmp_path)
    argv = ["generate", "--model", str(tiny_dream_dir), "--lora-modules", f"one={tmp_path / 'one'}"]
    argv += ["--gen-length", "8", "--block-length", "8", "--threshold", "0.5", "--no-stop-at-eos", "--json", "--raw"]
    assert cli([*argv, "--adapter", "one", "Question: 1 + 2?"]) == 0
    config = fastdllm.GenerationConfig(gen_length=8, block_length=8, threshold=0.5, stop_at_eos=False, adapter="one")
    alone = fastdllm.generate(ours, [tok.encode("Question: 1 + 2?")], config=config)
    assert json.loads(capsys.readouterr().out)["text"] == tok.decode(alone.sequences[0])
    assert cli([*argv[:3], "--lora", f"one={tmp_path / 'one'}", *argv[5:], "--adapter", "one", "Question: 1 + 2?"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == tok.decode(alone.sequences[0])  # --lora NAME=PATH too
    assert cli([*argv[:3], "--lora-modules", "nopath", "hi"]) == 2
    assert "--lora-modules: expected NAME=PATH" in capsys.readouterr().err


def test_lm_eval_scores_and_decodes_with_a_merged_adapter(tiny_dream_dir, tmp_path):
    """`lora=PATH` in model_args merges the adapter into the plugin's model, which every request
    type (generation, the ELBO) runs: its logits are the merged model's, not the base's."""
    from fastdllm import lm_eval_plugin
    from tests.test_eval import _FakeLM

    base, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu")
    adapter(qwen2_reference(base, tiny_dream_dir), tmp_path / "lora", seed=5)
    cls = lm_eval_plugin.make_model_class(_FakeLM, lambda name: lambda c: c)
    plain = cls(pretrained=str(tiny_dream_dir), dtype="float32", mc_num=2, mc_batch_size=2)
    adapted = cls(
        pretrained=str(tiny_dream_dir), dtype="float32", lora=str(tmp_path / "lora"), mc_num=2, mc_batch_size=2
    )
    merged, _ = fastdllm.load(tiny_dream_dir, dtype="float32", adapters=[tmp_path / "lora"])
    x = torch.randint(0, 700, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(adapted.model(x), merged(x))
        assert (adapted.model(x) - plain.model(x)).abs().max() > 1e-2
