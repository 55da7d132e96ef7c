"""Weight-only quantization: the packing, the kernels, quantizing at load, quantized checkpoints
(compressed-tensors, GPTQ) written by `quantize_checkpoint` and by an independent writer here,
memory accounting, and the errors a user meets."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fastdllm
from fastdllm import GenerationConfig, generate
from fastdllm.evaluation.tasks.scoring import extract_gsm8k_answer
from fastdllm.models import Transformer
from fastdllm.models.loading import load, quantize_checkpoint, save_pretrained
from fastdllm.quant import QuantizedLinear, quantize_weight, weight_bytes
from fastdllm.quant.formats import decode, encode, read_quant_format
from fastdllm.quant.weights import pack_int32, pack_nibbles, unpack_int32, unpack_nibbles

PROMPT = [{"role": "user", "content": "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"}]


def signed(bits, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), shape, generator=g, dtype=torch.int8)


# ---- packing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_int32_packing_round_trips(bits, dim):
    v = signed(bits, (40, 72))
    words = pack_int32(v, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == v.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(words, bits, v.shape[dim], dim), v)


def test_int32_packing_matches_the_layout_by_hand():
    # 4-bit, along columns: element j of a word at bits [4j, 4j+4), stored with +8
    v = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    codes = [x + 8 for x in v[0].tolist()]
    word = sum(c << (4 * j) for j, c in enumerate(codes))
    word = word - 2**32 if word >= 2**31 else word
    assert pack_int32(v, 4, 1).tolist() == [[word]]
    # 8-bit: four bytes per word, +128
    v8 = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    word8 = sum((x + 128) << (8 * j) for j, x in enumerate(v8[0].tolist()))
    assert pack_int32(v8, 8, 1).tolist() == [[word8 - 2**32 if word8 >= 2**31 else word8]]


def test_nibble_packing_round_trips():
    v = signed(4, (16, 32), seed=1)
    packed = pack_nibbles(v)
    assert packed.shape == (16, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), v)
    assert int(packed[0, 0]) == (int(v[0, 0]) + 8) | ((int(v[0, 1]) + 8) << 4)


# ---- round to nearest --------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 64)])
def test_quantize_weight_is_within_half_a_step(bits, group):
    w = torch.randn(48, 128)
    qw = quantize_weight(w, bits, group, scale_dtype=torch.float32)
    qmax = 2 ** (bits - 1) - 1
    assert qw.values.abs().max() <= qmax
    step = qw.scale.repeat_interleave(qw.group_size, 1)
    assert torch.all((qw.dequantize() - w).abs() <= step / 2 + 1e-6)
    # the largest magnitude of every group is exactly representable
    assert int(qw.values.abs().amax()) == qmax


def test_quantize_weight_rejects_a_group_that_does_not_divide():
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight(torch.randn(8, 96), 4, 64)
    with pytest.raises(ValueError, match="bits"):
        quantize_weight(torch.randn(8, 96), 3)


# ---- kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bits,group,out_f,zero,kernel,in_f",
    [
        (8, None, 48, False, "int8", 64),
        (4, 32, 48, False, "int4-cpu", 64),
        (4, 32, 48, True, "int4-cpu", 64),  # asymmetric: the kernel's float offsets
        (4, 32, 24, False, "dequantize", 64),  # output width not a multiple of 16
        (8, 32, 48, False, "dequantize", 64),  # grouped int8
        (8, None, 48, True, "dequantize", 64),  # asymmetric int8
        (8, None, 48, False, "dequantize", 24),  # input width not a multiple of 16 (the kernel crashes)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_computes_the_dequantized_linear(bits, group, out_f, zero, kernel, in_f, dtype):
    qw = quantize_weight(torch.randn(out_f, in_f), bits, group, scale_dtype=dtype)
    if zero:
        qw.zero = signed(bits, qw.scale.shape, seed=3) // 4
    bias = torch.randn(out_f)
    layer = QuantizedLinear(qw, bias, dtype=dtype)
    assert layer.kernel == kernel
    x = torch.randn(2, 5, in_f, dtype=dtype)
    expected = F.linear(x.float(), qw.dequantize(torch.float32), bias)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, 5, out_f)
    # a float32 layer's int8 / int4 kernel computes in bfloat16 (`linear.kernel_dtype_for`)
    exact = dtype == torch.float32 and kernel == "dequantize"
    assert layer.kernel_dtype == (torch.bfloat16 if kernel != "dequantize" else dtype)
    tol = 1e-4 if exact else 0.05 * expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= tol
    if layer.kernel_dtype != dtype:  # the bfloat16 products: the float32 ones of bfloat16 activations
        rounded = F.linear(x.bfloat16().float(), qw.dequantize(torch.float32), bias)
        assert (got - rounded).abs().max().item() <= 0.01 * rounded.abs().max().item()
    assert torch.allclose(
        layer.dequantized().float(),
        qw.dequantize(torch.float32),
        atol=1e-5 if dtype == torch.float32 else 1e-2,
        rtol=0 if dtype == torch.float32 else 1e-2,
    )


def test_int8_rows_above_the_threshold_dequantize_and_compute_the_same_linear():
    from fastdllm.quant.linear import dequantize_above_rows

    # the break-even grows with the weight, and with float32 activations four times further
    assert dequantize_above_rows("cpu", 512 * 192, kernel_casts=False) == 32
    assert dequantize_above_rows("cpu", 4096 * 4096, kernel_casts=False) == 128
    assert dequantize_above_rows("cpu", 4096 * 4096, kernel_casts=True) == 512
    assert dequantize_above_rows("cuda", 4096 * 4096, kernel_casts=False) == 0
    qw = quantize_weight(torch.randn(48, 64), 8, scale_dtype=torch.float32)
    layer = QuantizedLinear(qw, dtype=torch.float32)
    few, many = torch.randn(4, 64), torch.randn(layer.dequantize_above + 50, 64)
    assert torch.allclose(layer(many), F.linear(many, qw.dequantize()), atol=1e-4)  # dense, in float32
    want = F.linear(few, qw.dequantize())  # the kernel, in bfloat16
    assert (layer(few) - want).abs().max() <= 0.02 * want.abs().max()


def test_act_order_permutes_the_inputs():
    w = torch.randn(32, 64)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    qw = quantize_weight(w[:, order], 4, 32, scale_dtype=torch.float32)  # groups over the permuted columns
    qw.input_order = order
    layer = QuantizedLinear(qw)
    x = torch.randn(3, 64)
    assert torch.allclose(layer.dequantized(), qw.dequantize()[:, order], atol=1e-5)  # in the kernel's order
    want = F.linear(x, qw.dequantize())
    assert (layer(x) - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.allclose(qw.dequantize(), w, atol=qw.scale.max().item())


def test_a_quantized_layer_refuses_to_change_device_or_dtype():
    layer = QuantizedLinear(quantize_weight(torch.randn(16, 32), 4, 32))
    with pytest.raises(ValueError, match="dtype"):
        layer.to(torch.bfloat16)
    with pytest.raises(ValueError, match="move"):
        layer.to("meta")


# ---- quantizing at load ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    return {q: load(quantize=q) for q in (None, "int8", "int4")}


def test_quantized_embedded_model_is_a_transformer_with_smaller_linear_layers(embedded):
    (full, _), (w8, _), (w4, _) = embedded[None], embedded["int8"], embedded["int4"]
    assert full.dtype == torch.bfloat16 and full.quantization is None
    for model, bits in ((w8, 8), (w4, 4)):
        assert type(model) is Transformer and model.dtype == torch.bfloat16
        assert model.quantization["bits"] == [bits] and model.quantization["layers"] == 7 * model.args.n_layers
        assert isinstance(model.layers[0].attention.wq, QuantizedLinear)
        assert isinstance(model.output, torch.nn.Linear)  # the head stays in full precision
    base = weight_bytes(full)["linear_weight_bytes"]
    assert weight_bytes(w8)["linear_weight_bytes"] <= 0.55 * base
    assert weight_bytes(w4)["linear_weight_bytes"] <= 0.35 * base
    assert w4.quantization["group_size"] == [64]  # the embedded width 192 is not a multiple of 128


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_quantized_logits_stay_close_and_decoding_is_deterministic(embedded, q):
    (full, tok), (model, _) = embedded[None], embedded[q]
    ids = torch.tensor([tok.encode_chat(PROMPT)])
    # the masked answer positions, the only outputs decoding reads (the loss never trains a prompt
    # position's output, so its argmax is noise that quantization may flip)
    canvas = torch.cat([ids, torch.full((1, 64), full.args.mask_token_id)], dim=1)
    ref, got = full(canvas)[:, ids.shape[1] :].float(), model(canvas)[:, ids.shape[1] :].float()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    cfg = GenerationConfig(gen_length=64, block_length=32)
    a = generate(model, [ids[0].tolist()] * 2, config=cfg).sequences
    b = generate(model, [ids[0].tolist()] * 2, config=cfg).sequences
    assert torch.equal(a, b)
    assert "8" in tok.decode(a[0])


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_every_cache_policy_runs_on_a_quantized_model(embedded, cache):
    model, tok = embedded["int4"]
    ids = tok.encode_chat(PROMPT)
    out = generate(model, [ids, ids[:-3]], config=GenerationConfig(gen_length=64, block_length=32, cache=cache))
    assert out.sequences.shape == (2, 64)
    assert (out.kv_cache_bytes > 0) == (cache != "none")


@pytest.mark.slow
def test_compiled_layers_run_the_quantized_kernels(embedded):
    model, tok = embedded["int8"]
    ids = tok.encode_chat(PROMPT)
    cfg = GenerationConfig(gen_length=32, block_length=32)
    eager = generate(model, [ids], config=cfg).sequences
    compiled = generate(model, [ids], config=cfg.replace(compile=True)).sequences
    # Inductor may order a bf16 reduction differently, so a near-tie can pick another word; the
    # answer and nearly every token must still be the eager ones.
    assert extract_gsm8k_answer(tok.decode(compiled[0])) == extract_gsm8k_answer(tok.decode(eager[0])) is not None
    assert (eager == compiled).float().mean() >= 0.85


def test_quantize_at_load_errors():
    with pytest.raises(ValueError, match="quantize"):
        load(quantize="int3")
    with pytest.raises(ValueError, match="group_size"):
        load(quantize="int4", group_size=128)  # 192 is not a multiple of 128
    with pytest.raises(ValueError, match="group_size"):
        load(group_size=64)
    with pytest.raises(ValueError, match="group_size"):
        load(quantize="int4", group_size=48)


# ---- quantized checkpoints ---------------------------------------------------------------------
# Two families in the default suite (full attention, and block-causal MoE); every family in the slow set.
FAMILY_FIXTURES = ["tiny_llada", "tiny_llada2"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("tiny_dream", "tiny_sdar", "tiny_v2", "tiny_llada_moe")
]


@pytest.mark.parametrize("fixture", FAMILY_FIXTURES)
@pytest.mark.parametrize("fmt,bits", [("compressed-tensors", 4), ("compressed-tensors", 8), ("gptq", 4), ("gptq", 8)])
def test_quantize_then_load_equals_quantizing_at_load(request, tmp_path, tokenizer, fixture, fmt, bits):
    model = request.getfixturevalue(fixture)
    src = save_pretrained(model, tmp_path / "src", tokenizer, dtype=torch.float32)
    dst = quantize_checkpoint(src, tmp_path / "dst", bits, quant_format=fmt, max_shard_bytes=30_000)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt
    loaded, _ = load(dst, device="cpu")
    at_load, _ = load(src, device="cpu", quantize=f"int{bits}")
    assert loaded.quantization["format"] == fmt and loaded.quantization["bits"] == [bits]
    ids = torch.randint(0, 800, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), at_load(ids))
    assert not torch.equal(loaded(ids), model(ids))  # quantization did change the weights


def test_checkpoints_hold_the_formats_tensors(tmp_path, tiny_llada, tokenizer):
    src = save_pretrained(tiny_llada, tmp_path / "src", tokenizer, dtype=torch.float32)
    ct = load_file(quantize_checkpoint(src, tmp_path / "ct", 4) / "model.safetensors")
    gptq = load_file(quantize_checkpoint(src, tmp_path / "gptq", 4, quant_format="gptq") / "model.safetensors")
    p = "model.transformer.blocks.0.q_proj"
    assert ct[f"{p}.weight_packed"].shape == (32, 4) and ct[f"{p}.weight_packed"].dtype == torch.int32
    assert ct[f"{p}.weight_scale"].shape == (32, 1) and ct[f"{p}.weight_shape"].tolist() == [32, 32]
    assert f"{p}.weight" not in ct and "model.transformer.ff_out.weight" in ct  # the head is not quantized
    assert gptq[f"{p}.qweight"].shape == (4, 32) and gptq[f"{p}.qzeros"].shape == (1, 4)
    assert gptq[f"{p}.scales"].shape == (1, 32) and gptq[f"{p}.g_idx"].tolist() == [0] * 32
    assert gptq[f"{p}.qzeros"].view(torch.uint32).unique().tolist() == [0x77777777]  # zero 8, stored minus one
    ignore = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["model.transformer.ff_out"]


def _gptq_layer(w: torch.Tensor, bits: int, group: int, order: torch.Tensor | None, seed: int):
    """GPTQ tensors for `w` written from the format's description with plain loops (asymmetric,
    optionally act-order), and the weight they stand for."""
    out_f, in_f = w.shape
    per, maxq = 32 // bits, 2**bits - 1
    g_idx = (torch.arange(in_f) // group) if order is None else (torch.argsort(order) // group)
    n_groups = in_f // group
    scales = torch.zeros(n_groups, out_f)
    zeros = torch.zeros(n_groups, out_f, dtype=torch.long)
    codes = torch.zeros(in_f, out_f, dtype=torch.long)
    for g in range(n_groups):
        cols = (g_idx == g).nonzero().flatten()
        lo, hi = w[:, cols].amin(1).clamp(max=0), w[:, cols].amax(1).clamp(min=0)
        scales[g] = ((hi - lo) / maxq).clamp(min=1e-8)
        zeros[g] = torch.round(-lo / scales[g]).long().clamp(0, maxq)
        codes[cols] = torch.clamp(torch.round(w[:, cols].t() / scales[g]) + zeros[g], 0, maxq).long()
    qweight = torch.zeros(in_f // per, out_f, dtype=torch.long)
    for i in range(in_f):
        qweight[i // per] |= codes[i] << (bits * (i % per))
    qzeros = torch.zeros(n_groups, out_f // per, dtype=torch.long)
    for o in range(out_f):
        qzeros[:, o // per] |= ((zeros[:, o] - 1) & maxq) << (bits * (o % per))
    as_int32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)  # noqa: E731
    scales = scales.to(torch.float16)  # as GPTQ stores them
    weight = ((codes - zeros[g_idx]) * scales.float()[g_idx]).t()
    return {
        "qweight": as_int32(qweight),
        "qzeros": as_int32(qzeros),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }, weight


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False)])
def test_gptq_checkpoints_from_an_independent_writer_load_exactly(tmp_path, tiny_llada, tokenizer, bits, act_order):
    """Asymmetric zero points and act-order (shuffled groups) as GPTQ writes them: the quantized
    model equals the full-precision one holding the weights the tensors stand for."""
    src = save_pretrained(tiny_llada, tmp_path / "src", tokenizer, dtype=torch.float32)
    tensors = load_file(src / "model.safetensors")
    dense = {}
    for name in [n for n in tensors if n.endswith(("_proj.weight", "ff_out.weight", "attn_out.weight"))]:
        if name == "model.transformer.ff_out.weight":
            continue  # the head stays in float
        prefix = name.removesuffix(".weight")
        order = (
            torch.randperm(tensors[name].shape[1], generator=torch.Generator().manual_seed(1)) if act_order else None
        )
        layer, weight = _gptq_layer(tensors.pop(name), bits, 32, order, seed=0)
        tensors.update({f"{prefix}.{k}": v for k, v in layer.items()})
        dense[name] = weight.contiguous()
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (src / "quantize_config.json").write_text(
        json.dumps({"bits": bits, "group_size": 32, "desc_act": act_order, "sym": False})
    )
    model, _ = load(src, device="cpu")
    assert model.quantization["format"] == "gptq" and model.quantization["symmetric"] is False
    # the reference: the same checkpoint in float with the weights the tensors stand for
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_tensors = {k: v for k, v in tensors.items() if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))}
    ref_tensors.update(dense)
    save_file(ref_tensors, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    tokenizer.save(ref_dir)
    ref, _ = load(ref_dir, device="cpu")
    assert_same_weights(model, ref)
    ids = torch.randint(0, 800, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_same_function(model(ids), ref(ids))


def assert_same_weights(quantized, ref):
    """Every quantized layer holds exactly the weight of the float model's layer of that name."""
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, QuantizedLinear)}
    assert layers
    for name, layer in layers.items():
        want = ref.get_submodule(name).weight
        if layer.input_order is not None:
            want = want[:, layer.input_order]
        assert torch.allclose(layer.dequantized(), want, atol=1e-5, rtol=1e-5), name


def assert_same_function(got, want):
    """Equal logits; float32 models' int8 / int4 kernels compute in bfloat16 (`linear.kernel_dtype_for`)."""
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_compressed_tensors_asymmetric_groups_load_exactly(tmp_path, tiny_dream, tokenizer):
    src = save_pretrained(tiny_dream, tmp_path / "src", tokenizer, dtype=torch.float32)
    tensors = load_file(src / "model.safetensors")
    dense = {}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors.pop(name)
        prefix = name.removesuffix(".weight")
        g = w.reshape(w.shape[0], -1, 32)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zp = torch.clamp(torch.round(-8 - lo / scale), -8, 7)
        q = torch.clamp(torch.round(g / scale[..., None]) + zp[..., None], -8, 7)
        dense[name] = ((q - zp[..., None]) * scale[..., None]).reshape(w.shape)
        words = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.long)
        flat = q.reshape(w.shape).long() + 8
        for j in range(w.shape[1]):
            words[:, j // 8] |= flat[:, j] << (4 * (j % 8))
        zwords = torch.zeros(w.shape[0] // 8, zp.shape[1], dtype=torch.long)
        for o in range(w.shape[0]):
            zwords[o // 8] |= (zp[o].long() + 8) << (4 * (o % 8))
        as_int32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)  # noqa: E731
        tensors.update(
            {
                f"{prefix}.weight_packed": as_int32(words),
                f"{prefix}.weight_scale": scale,
                f"{prefix}.weight_zero_point": as_int32(zwords),
                f"{prefix}.weight_shape": torch.tensor(list(w.shape)),
            }
        )
    save_file(tensors, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    (src / "config.json").write_text(json.dumps(cfg))
    model, _ = load(src, device="cpu")
    assert model.quantization["symmetric"] is False and model.quantization["kernels"] == ["int4-cpu"]
    ref = type(tiny_dream)(tiny_dream.args, family=tiny_dream.family)
    state = {k: v.clone() for k, v in tiny_dream.state_dict().items()}
    names = tiny_dream.family.weight_names(tiny_dream.args)
    for ours, theirs in names.items():
        if theirs in dense:
            state[ours] = dense[theirs]
    ref.load_state_dict(state)
    assert_same_weights(model, ref)
    ids = torch.randint(0, 800, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_same_function(model(ids), ref.eval()(ids))


def test_quantized_experts_in_a_checkpoint_are_dequantized_into_their_stack(tmp_path, tiny_llada2, tokenizer):
    src = save_pretrained(tiny_llada2, tmp_path / "src", tokenizer, dtype=torch.float32)
    tensors = load_file(src / "model.safetensors")
    expert = [n for n in tensors if ".experts." in n and n.endswith(".weight")]
    assert expert
    for name in expert:
        qw = quantize_weight(tensors.pop(name), 4, 32, scale_dtype=torch.float32)
        tensors.update(encode("gptq", qw, name.removesuffix(".weight")))
        tensors[name + ".reference"] = qw.dequantize()
    reference = {k.removesuffix(".reference"): tensors.pop(k) for k in list(tensors) if k.endswith(".reference")}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32}))
    model, _ = load(src, device="cpu")
    names = model.family.weight_names(model.args)
    state = model.state_dict()
    for ours, theirs in names.items():
        if isinstance(theirs, tuple):
            for e, t in enumerate(theirs):
                assert torch.equal(state[ours][e], reference[t])


def test_unknown_or_unsupported_quantization_is_one_clear_line(tmp_path, tiny_llada, tokenizer):
    src = save_pretrained(tiny_llada, tmp_path / "m", tokenizer, dtype=torch.float32)
    cfg = json.loads((src / "config.json").read_text())
    cases = [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8}}
                },
            },
            "activation",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}},
            },
            "type 'float' with num_bits 4",
        ),
    ]
    for qc, words in cases:
        (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(ValueError) as e:
            load(src, device="cpu")
        assert words in str(e.value) and "fastdllm reads" in str(e.value) and "\n" not in str(e.value)


def test_quantized_models_are_not_saved_or_quantized_twice(tmp_path, embedded, tiny_llada, tokenizer):
    with pytest.raises(ValueError, match="quantize_checkpoint"):
        save_pretrained(embedded["int8"][0], tmp_path / "x")
    src = save_pretrained(tiny_llada, tmp_path / "src", tokenizer, dtype=torch.float32)
    dst = quantize_checkpoint(src, tmp_path / "q", 8)
    with pytest.raises(ValueError, match="already quantized"):
        load(dst, quantize="int4")
    with pytest.raises(ValueError, match="format"):
        quantize_checkpoint(src, tmp_path / "z", 8, quant_format="awq")


def test_decode_checks_the_config_against_the_tensors(tmp_path):
    qw = quantize_weight(torch.randn(16, 64), 4, 32)
    tensors = encode("compressed-tensors", qw, "p")
    fmt = read_quant_format(
        tmp_path,
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
            }
        },
    )
    with pytest.raises(ValueError, match="8"):
        decode(fmt, tensors.__getitem__, "p", tensors.__contains__)


# ---- memory accounting and the command line ----------------------------------------------------
def test_eval_reports_weight_and_kv_cache_bytes(embedded):
    from fastdllm.evaluation.harness import evaluate

    model, tok = embedded["int4"]
    with_cache = evaluate(
        model, tok, "arith", limit=2, config=GenerationConfig(gen_length=64, cache="dual"), progress=False
    )
    none = evaluate(model, tok, "arith", limit=2, config=GenerationConfig(gen_length=64, cache="none"), progress=False)
    assert with_cache["weight_bytes"] == weight_bytes(model)["weight_bytes"]
    assert with_cache["quantization"]["bits"] == [4]
    a = model.args
    prompt_len = len(tok.encode_chat([{"role": "user", "content": ""}]))
    per_position = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2  # K and V, bfloat16
    assert with_cache["kv_cache_bytes"] >= per_position * (64 + prompt_len)
    assert with_cache["kv_cache_bytes"] % per_position == 0
    assert none["kv_cache_bytes"] == 0


def test_the_quantize_command_and_the_quantize_flag(tmp_path, capsys):
    from fastdllm.cli.main import main

    dst = tmp_path / "w4"
    assert main(["quantize", "llada-arith", str(dst), "--bits", "4"]) == 0
    assert "42 layers 4-bit" in capsys.readouterr().out
    assert main(["generate", "--model", str(dst), "--no-stats", PROMPT[0]["content"]]) == 0
    from_file = capsys.readouterr().out
    assert main(["generate", "--quantize", "int4", "--no-stats", PROMPT[0]["content"]]) == 0
    assert capsys.readouterr().out == from_file
    assert main(["generate", "--quantize", "int4", "--group-size", "128", "x"]) == 2
    assert "group_size" in capsys.readouterr().err
    assert main(["quantize", "llada-arith", str(tmp_path / "z"), "--bits", "3"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("FASTDLLM_CT_PYTHON"),
    reason="set FASTDLLM_CT_PYTHON to an interpreter with compressed-tensors installed",
)
def test_compressed_tensors_library_reads_ours_and_we_read_its(tmp_path):
    """The library's own compressor decompresses what we write, and we decode what it writes."""
    layers = [
        {
            "prefix": "a",
            "shape": [32, 128],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
        },
        {
            "prefix": "b",
            "shape": [48, 64],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        },
        {
            "prefix": "c",
            "shape": [32, 128],
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
        },
        {
            "prefix": "d",
            "shape": [32, 64],
            "weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"},
        },
    ]
    ours, ours_dense = {}, {}
    for layer in layers:
        w = layer["weights"]
        qw = quantize_weight(
            torch.randn(layer["shape"]), w["num_bits"], w.get("group_size"), scale_dtype=torch.bfloat16
        )
        if not w["symmetric"]:
            qw.zero = signed(w["num_bits"], qw.scale.shape) // 4
        ours.update(encode("compressed-tensors", qw, layer["prefix"]))
        ours_dense[layer["prefix"]] = qw.dequantize(torch.float32)
    save_file(ours, str(tmp_path / "ours.safetensors"))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"ours": str(tmp_path / "ours.safetensors"), "out": str(tmp_path), "layers": layers}))
    script = Path(__file__).parent / "reference" / "compressed_tensors_layers.py"
    subprocess.run([os.environ["FASTDLLM_CT_PYTHON"], str(script), str(job)], check=True, timeout=300)
    by_library = load_file(tmp_path / "ours_by_library.safetensors")
    for prefix, dense in ours_dense.items():
        assert torch.allclose(by_library[prefix], dense, atol=1e-2, rtol=1e-2), prefix
    theirs, theirs_dense = (
        load_file(tmp_path / "library.safetensors"),
        load_file(tmp_path / "library_dequantized.safetensors"),
    )
    fmt = read_quant_format(
        tmp_path,
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            }
        },
    )
    fmt.bits = None  # mixed bit widths in one file
    for prefix, dense in theirs_dense.items():
        qw = decode(fmt, theirs.__getitem__, prefix, theirs.__contains__)
        assert torch.allclose(qw.dequantize(torch.float32), dense, atol=1e-2, rtol=1e-2), prefix


CT_FIXTURES = Path(__file__).parent / "fixtures" / "compressed_tensors"


@pytest.mark.parametrize(
    "name,stored",
    [
        ("llada-fp8", torch.float8_e4m3fn),
        ("llada-nvfp4", torch.uint8),
        ("gemma-fp8", torch.float8_e4m3fn),
        ("gemma-nvfp4", torch.uint8),
    ],
)
def test_a_float_quantized_checkpoint_decodes_as_the_librarys_decompression(name, stored):
    """FP8 and NVFP4 checkpoints made by the reference tools: tiny LLaDAs quantized by
    compressed-tensors' own compressors under llm-compressor's FP8_DYNAMIC and NVFP4A16 schemes
    (`tests/reference/compressed_tensors_fp8.py`), and tiny DiffusionGemmas quantized by
    llm-compressor's `oneshot` itself, its mixture of experts unfused into each expert's layers
    (`tests/reference/llmcompressor_gemma.py`). Their linear layers stay FP8 / packed FP4 in memory
    and dequantize to exactly the library's decompressed weights, the experts load as the library
    decompresses them, and the logits are those of the model holding the library's weights."""
    from fastdllm.quant.floating import FloatingLinear

    folder = CT_FIXTURES / name
    model, tok = fastdllm.load(str(folder), dtype="float32")
    library = load_file(folder / "library_dequantized.safetensors")
    names = model.family.weight_names(model.args)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FloatingLinear)}
    assert len(layers) == {"llada": 14, "gemma": 22}[name.split("-")[0]]
    for i, layer in enumerate(model.layers if model.args.n_experts else ()):  # the experts, one by one
        for e in range(model.args.n_experts):
            expert = f"model.decoder.layers.{i}.experts.{e}"
            gate_up = torch.cat([library[f"{expert}.gate_proj"], library[f"{expert}.up_proj"]]).float()
            assert torch.equal(layer.experts_gate_up[e], gate_up)
            assert torch.equal(layer.experts_down[e], library[f"{expert}.down_proj"].float())
    ids = torch.tensor([tok.encode("Question: what is 3 + 4?") + [model.mask_token_id] * 8])
    ours = model(ids)
    for layer_name, layer in layers.items():
        held = [getattr(layer, part) for part in layer.parts]
        assert held[0].dtype == stored  # a byte a weight (FP8) or half of one (FP4) in memory
        theirs = library[names[f"{layer_name}.weight"].removesuffix(".weight")]
        assert torch.equal(layer.weight_type(*held).dequantize(torch.float32), theirs.float())
        parent, _, attr = layer_name.rpartition(".")
        dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
        dense.weight.data = theirs.float()
        setattr(model.get_submodule(parent), attr, dense)
    model._compiled_layers = None
    assert torch.equal(ours, model(ids))


def test_fp8_schemes_the_loader_cannot_run_are_refused_by_name(tmp_path):
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    block = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
    with pytest.raises(ValueError, match="weight strategy 'block' for FP8"):
        read_quant_format(tmp_path, {"quantization_config": {**qc, "config_groups": {"g": {"weights": block}}}})
    mxfp4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
    with pytest.raises(ValueError, match="weights of type 'float' with num_bits 4"):
        read_quant_format(tmp_path, {"quantization_config": {**qc, "config_groups": {"g": {"weights": mxfp4}}}})
