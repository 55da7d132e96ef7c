"""Model code parity, cache exactness, checkpoint round trip, and clear loading errors."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastdllm
from fastdllm.engine.kv.pages import PagedKVCache
from fastdllm.models import llada
from fastdllm.models.loading import save_pretrained

from .conftest import REPO

FORMATS = REPO / "tests" / "data"  # the real checkpoints' config files, as published

transformers = pytest.importorskip("transformers")


def _full_mask(batch, length):
    return torch.ones(batch, 1, length, length, dtype=torch.bool)


def _llada_to_llama(state: dict, n_layers: int) -> dict:
    """An independent name mapping: LLaDA checkpoint names -> transformers' Llama names."""
    out = {
        "model.embed_tokens.weight": state["model.transformer.wte.weight"],
        "model.norm.weight": state["model.transformer.ln_f.weight"],
        "lm_head.weight": state["model.transformer.ff_out.weight"],
    }
    pairs = {
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "attn_out": "self_attn.o_proj",
        "ff_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "ff_out": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ff_norm": "post_attention_layernorm",
    }
    for i in range(n_layers):
        for theirs, hf in pairs.items():
            out[f"model.layers.{i}.{hf}.weight"] = state[f"model.transformer.blocks.{i}.{theirs}.weight"]
    return out


def _weights(folder) -> dict:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def test_llada_matches_transformers_llama(tiny_llada_dir):
    model, _ = fastdllm.load(tiny_llada_dir, dtype="float32", device="cpu")
    a = model.args
    cfg = transformers.LlamaConfig(
        hidden_size=a.dim,
        intermediate_size=a.hidden_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        max_position_embeddings=a.max_seq_len,
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        attention_bias=False,
        tie_word_embeddings=False,
    )
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(_llada_to_llama(_weights(tiny_llada_dir), a.n_layers), strict=True)
    x = torch.randint(0, 700, (2, 37))
    with torch.no_grad():
        ours = model(x)
        theirs = ref(x, attention_mask=_full_mask(2, 37)).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def qwen2_reference(model, folder):
    """transformers' Qwen2 holding a Dream-layout checkpoint's weights (Dream uses Qwen2's names)."""
    a = model.args
    cfg = transformers.Qwen2Config(
        hidden_size=a.dim,
        intermediate_size=a.hidden_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        max_position_embeddings=a.max_seq_len,
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    ref.load_state_dict(_weights(folder), strict=True)
    return ref


def test_dream_matches_transformers_qwen2(tiny_dream_dir):
    model, _ = fastdllm.load(tiny_dream_dir, dtype="float32", device="cpu")
    a = model.args
    assert a.n_kv_heads < a.n_heads and a.qkv_bias and a.shifted_logits
    ref = qwen2_reference(model, tiny_dream_dir)
    x = torch.randint(0, 700, (2, 29))
    with torch.no_grad():
        ours = model(x)
        theirs = ref(x, attention_mask=_full_mask(2, 29)).logits
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    # logits_for hides the shift: row j predicts token start + j, i.e. native logit start + j - 1.
    with torch.no_grad():
        adapted = model.logits_for(x, 5, 12)
    torch.testing.assert_close(adapted, ours[:, 4:11])


def test_llada_logits_for_is_unshifted(tiny_llada):
    x = torch.randint(0, 700, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(tiny_llada.logits_for(x, 5, 12), tiny_llada(x)[:, 5:12])


def _padded_batch(lengths, total, vocab=700, pad=0):
    rows = [torch.randint(1, vocab, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(rows), width + total), pad)
    mask = torch.zeros(len(rows), width + total, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) : width] = r
        mask[i, width - len(r) :] = True
    ids[:, width:] = torch.randint(1, vocab, (len(rows), total))
    return ids, mask


@pytest.mark.parametrize("arch", ["tiny_llada", "tiny_dream"])
@pytest.mark.parametrize("lengths", [[24], [24, 17, 13]])
def test_cached_windows_equal_full_forward(arch, lengths, request):
    """Right after a packed forward fills the rows' pages, prefix- and dual-mode windows of any
    span give each row's full forward's logits there (fp32, tight tolerance), rows of different
    lengths packed together."""
    model = request.getfixturevalue(arch)
    shift = int(model.args.shifted_logits)
    x = torch.randint(
        5, model.args.vocab_size - 5, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = [model.logits_for(x[i : i + 1, :n], 1, n)[0] for i, n in enumerate(lengths)]
        for s, width in [(11, 2), (5, 4), (9, 4)]:
            cache = PagedKVCache.for_rows(model, len(lengths), max(lengths))
            filled = model.packed_logits(x, [(i, 0, n, n, s) for i, n in enumerate(lengths)], cache)
            prefix = model.packed_logits(x, [(i, s - shift, n, n, s) for i, n in enumerate(lengths)], cache)
            dual = model.packed_logits(x, [(i, s - shift, s + width, n, s) for i, n in enumerate(lengths)], cache)
            for i, n in enumerate(lengths):
                want = full[i][s - 1 : n - 1]
                torch.testing.assert_close(filled[i], want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(prefix[i], want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(dual[i], want[:width], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["tiny_llada", "tiny_dream"])
def test_padded_row_equals_row_alone(arch, request):
    model = request.getfixturevalue(arch)
    ids, mask = _padded_batch([13, 5], 10)
    width = ids.shape[1]
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        alone = model(ids[1:, mask[1]])
    torch.testing.assert_close(batched[1, mask[1]], alone[0], atol=1e-5, rtol=1e-5)
    assert width > alone.shape[1]


def test_round_trip_is_bit_exact(tiny_llada, tiny_llada_dir, tokenizer):
    assert (tiny_llada_dir / "model.safetensors.index.json").is_file()
    assert len(list(tiny_llada_dir.glob("model-*-of-*.safetensors"))) > 1
    model, tok = fastdllm.load(tiny_llada_dir, dtype="float32", device="cpu")
    saved, loaded = tiny_llada.state_dict(), model.state_dict()
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    text = "Tom has 5 apples. <|eot_id|>"
    assert tok.encode(text) == tokenizer.encode(text)
    assert tok.chat_template == tokenizer.chat_template
    assert model.stop_token_ids == tokenizer.stop_token_ids()
    # weight files get the mode the umask gives new files, as the JSON files beside them do
    modes = {p.suffix: p.stat().st_mode & 0o777 for p in tiny_llada_dir.iterdir()}
    assert modes[".safetensors"] == modes[".json"] == 0o666 & ~current_umask()


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_saved_llada_config_has_every_reference_field(tiny_llada_dir):
    reference = json.loads((FORMATS / "llada-8b-instruct.config.json").read_text())
    saved = json.loads((tiny_llada_dir / "config.json").read_text())
    assert set(reference) <= set(saved)
    assert saved["model_type"] == "llada" and saved["d_model"] != reference["d_model"]
    assert llada.REFERENCE_CONFIG == reference  # our copy of the real config is verbatim


def test_real_llada_config_shrunk_loads(tmp_path, tokenizer, monkeypatch):
    """LLaDA-8B-Instruct's exact config.json with the layer count and widths shrunk; in its own
    bfloat16 on a CPU that computes bfloat16, in float32 on one that emulates it."""
    cfg = json.loads((FORMATS / "llada-8b-instruct.config.json").read_text())
    cfg.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=96)
    cfg.update(mask_token_id=tokenizer.token_to_id("<|mdm_mask|>"), vocab_size=1024, embedding_size=1024)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    names = llada.weight_names(llada.args_from_config(cfg))
    tensors = {}
    for ours, theirs in names.items():
        if "norm" in ours:
            shape = (64,)
        elif ours == "tok_embeddings.weight" or ours == "output.weight":
            shape = (1024, 64)
        elif ".w1." in ours or ".w3." in ours:
            shape = (96, 64)
        elif ".w2." in ours:
            shape = (64, 96)
        else:
            shape = (64, 64)
        tensors[theirs] = torch.randn(shape, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    tokenizer.save(tmp_path)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False})
    emulated, _ = fastdllm.load(tmp_path, device="cpu")
    assert emulated.dtype == torch.float32 and "no native bfloat16" in emulated.dtype_note
    assert fastdllm.load(tmp_path, device="cpu", dtype="bfloat16")[0].dtype == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "amx_bf16": True})
    model, _ = fastdllm.load(tmp_path, device="cpu")
    assert model.dtype == torch.bfloat16 and model.dtype_note is None  # the config's torch_dtype
    assert model.args.rope_theta == 500000.0 and model.args.max_seq_len == 4096
    assert model(torch.randint(0, 1000, (1, 9))).shape == (1, 9, 1024)


def test_dream_tokenizer_from_vocab_and_merges(tmp_path, tokenizer, tiny_dream):
    """Dream ships vocab.json + merges.txt + added_tokens.json (no tokenizer.json)."""
    tokenizer.fast.model.save(str(tmp_path))
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    added = {t: len(vocab) + i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mdm_mask|>"])}
    (tmp_path / "added_tokens.json").write_text(json.dumps(added))
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": chatml, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    )
    save_pretrained(tiny_dream, tmp_path / "m", dtype=torch.float32)
    for f in (tmp_path / "m").iterdir():
        shutil.move(str(f), tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mask_token_id"] = added["<|mdm_mask|>"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, tok = fastdllm.load(tmp_path, device="cpu")
    text = "Ann has 12 pencils.\nShe gives 3 to Tom!"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(" 12")) >= 2 and len(tokenizer.encode(" 12")) == 1  # Qwen2 splits digits
    prompt = tok.render_chat([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_end|>") == [added["<|im_end|>"]]
    assert added["<|im_end|>"] in model.stop_token_ids and added["<|endoftext|>"] in model.stop_token_ids


# ---- bad input: clear errors naming the file or field ---------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config_names_the_file(tmp_path, tiny_llada_dir):
    d = _copy(tiny_llada_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        fastdllm.load(d)


def test_missing_shard_names_the_file(tmp_path, tiny_llada_dir):
    d = _copy(tiny_llada_dir, tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        fastdllm.load(d)


def test_unknown_model_type_names_the_field(tmp_path, tiny_llada_dir):
    d = _copy(tiny_llada_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        fastdllm.load(d)


def test_wrong_tensor_shape_names_the_tensor(tmp_path, tiny_dream_dir):
    d = _copy(tiny_dream_dir, tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*\(3, 3\)"):
        fastdllm.load(d)


def test_mask_token_absent_from_tokenizer(tmp_path, tiny_llada_dir):
    d = _copy(tiny_llada_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["mask_token_id"] = 126336  # LLaDA-8B's id: far outside our small vocabulary
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id 126336"):
        fastdllm.load(d)


def _without_special_ids(folder, rename: dict[str, str]):
    """A checkpoint as its reference's own code saves one: config.json states no mask or EOS id, and
    the tokenizer's special tokens are renamed (our tiny vocabulary's ids, the family's texts)."""
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("mask_token_id", "eos_token_id"):
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((folder / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["content"] = rename.get(added["content"], added["content"])
    (folder / "tokenizer.json").write_text(json.dumps(tok))


@pytest.mark.parametrize("name", ["tiny_v2", "tiny_llada2", "tiny_sdar"])
def test_special_ids_a_config_leaves_out_come_from_the_tokenizer(name, request, tokenizer, tmp_path):
    """Not the published ids (151665, 156895, ...: past this small vocabulary): the ids of the
    family's mask and EOS tokens in the checkpoint's own tokenizer; a tokenizer without the mask
    token is refused, naming the token looked for."""
    model = request.getfixturevalue(name)
    texts = model.family.special_tokens
    folder = save_pretrained(model, tmp_path / "named", tokenizer, dtype=torch.float32)
    mask_id, eos_id = tokenizer.token_to_id("<|mdm_mask|>"), tokenizer.token_to_id("<|endoftext|>")
    _without_special_ids(folder, {"<|mdm_mask|>": texts["mask_token_id"], "<|endoftext|>": texts["eos_token_id"]})
    loaded, _ = fastdllm.load(str(folder), dtype=torch.float32)
    assert (loaded.mask_token_id, loaded.args.eos_token_id) == (mask_id, eos_id)
    ids = [tokenizer.encode("Question: 1 + 1")]
    config = fastdllm.GenerationConfig.for_model(model, fastdllm.GenerationConfig(gen_length=16, block_length=8))
    assert torch.equal(
        fastdllm.generate(loaded, ids, config=config).sequences, fastdllm.generate(model, ids, config=config).sequences
    )
    other = save_pretrained(model, tmp_path / "unnamed", tokenizer, dtype=torch.float32)
    _without_special_ids(other, {})
    with pytest.raises(ValueError, match=re.escape(repr(texts["mask_token_id"]))):
        fastdllm.load(str(other), dtype=torch.float32)


def test_pickle_only_checkpoint_is_refused(tmp_path, tiny_llada_dir):
    d = tmp_path / "m"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llada_dir / name, d)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors only"):
        fastdllm.load(d)


def test_missing_folder_and_unreachable_hub_id_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="model folder not found.*embedded models: llada-arith, dream-arith"):
        fastdllm.load(tmp_path / "nope" / "deeper")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'no-such-org/no-such-model'"):
        fastdllm.load("no-such-org/no-such-model")


def test_bfloat16_forward_close_to_fp32(tiny_llada_dir):
    m32, _ = fastdllm.load(tiny_llada_dir, dtype="float32", device="cpu")
    m16, _ = fastdllm.load(tiny_llada_dir, dtype="bfloat16", device="cpu")
    x = torch.randint(0, 700, (1, 16))
    a, b = m32(x), m16(x).float()
    assert m16.dtype == torch.bfloat16
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_hub_ids_pass_revision_local_files_only_and_token(monkeypatch, tiny_llada_dir):
    import huggingface_hub

    from fastdllm.models.loading import resolve_model_path

    seen = {}

    def fake_snapshot_download(**kw):
        seen.update(kw)
        return str(tiny_llada_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("org/model", revision="v1.2", local_files_only=True, token="t") == tiny_llada_dir
    assert (seen["repo_id"], seen["revision"], seen["local_files_only"], seen["token"]) == (
        "org/model",
        "v1.2",
        True,
        "t",
    )
    model, _ = fastdllm.load("org/model", revision="abc123", dtype="float32")
    assert seen["revision"] == "abc123" and model.args.n_layers > 0


def test_an_offline_machine_fails_fast_with_the_cache_only(monkeypatch, tiny_llada_dir):
    """Where the hub cannot be reached, a hub id is looked up in the local cache alone (no download
    and its minutes of retries), and the error says the hub is unreachable; `plan` too."""
    import huggingface_hub
    from huggingface_hub import constants

    from fastdllm.models import loading, plan

    calls = []

    def fake_snapshot_download(**kw):
        calls.append(kw["local_files_only"])
        if not kw["local_files_only"] or kw["repo_id"] != "org/cached":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        return str(tiny_llada_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert loading.hub_unreachable() == "HF_HUB_OFFLINE is set"
    assert loading.resolve_model_path("org/cached") == tiny_llada_dir
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        loading.resolve_model_path("org/elsewhere")
    assert calls == [True, True]  # never a download
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    assert "cannot be reached" in loading.hub_unreachable()
    asked = []
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda *a, **kw: asked.append(kw["local_files_only"]) or 1 / 0
    )
    with pytest.raises(FileNotFoundError, match="hub.invalid. cannot be reached"):
        plan.config_of("org/elsewhere")
    assert asked == [True]


def test_local_files_only_never_reaches_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        fastdllm.load("no-such-org/no-such-model", local_files_only=True)


def test_dream_generation_config_is_written_read_and_gives_the_defaults(
    tiny_dream, tiny_llada, tokenizer, tmp_path, capsys
):
    from fastdllm.cli import main as cli

    dream_dir, llada_dir = tmp_path / "dream", tmp_path / "llada"
    save_pretrained(tiny_llada, llada_dir, tokenizer, dtype=torch.float32)
    assert not (llada_dir / "generation_config.json").exists()
    tiny_dream.generation_config = {"alg": "entropy", "eps": 0.01}
    try:
        save_pretrained(tiny_dream, dream_dir, tokenizer, dtype=torch.float32)
    finally:
        tiny_dream.generation_config = {}
    written = json.loads((dream_dir / "generation_config.json").read_text())
    assert (
        written["alg"] == "entropy" and written["eps"] == 0.01 and written["mask_token_id"] == tiny_dream.mask_token_id
    )
    model, _ = fastdllm.load(dream_dir, dtype="float32")
    assert fastdllm.GenerationConfig.for_model(model).alg == "entropy"
    assert fastdllm.GenerationConfig.for_model(model, alg="maskgit_plus").alg == "maskgit_plus"
    # the CLI: the checkpoint's defaults for flags not given, the flags given win
    for argv, alg in (
        (["--gen-length", "32"], "entropy"),
        (["--gen-length", "32", "--alg", "maskgit_plus"], "maskgit_plus"),
    ):
        assert cli.main(["generate", "--model", str(dream_dir), "--json", "--raw", *argv, "hi"]) == 0
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert record["config"]["alg"] == alg and record["config"]["eps"] == 0.01


@pytest.mark.parametrize("fixture", ["tiny_dream_dir", "tiny_llada_dir"])
def test_every_stop_id_a_checkpoint_lists_ends_the_answer(fixture, request, tmp_path):
    """`eos_token_id` as a list in config.json and in generation_config.json (Qwen-based checkpoints
    and DiffusionGemma ship lists): every id of both is a stop token, and decoding stops at one."""
    folder = tmp_path / "lists"
    shutil.copytree(request.getfixturevalue(fixture), folder)
    model, tok = fastdllm.load(str(folder), dtype="float32")
    eos = model.args.eos_token_id
    config = fastdllm.GenerationConfig(gen_length=32, block_length=8, threshold=0.5)
    prompt = tok.encode("Question: what is 2 + 3?")
    free = fastdllm.generate(model, [prompt], config=config.replace(stop_at_eos=False)).sequences[0].tolist()
    first, second = [t for t in dict.fromkeys(free) if t != eos and t not in model.stop_token_ids][:2]
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [eos, second]}))
    gen = folder / "generation_config.json"
    own = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**own, "eos_token_id": [first, eos]}))
    model, tok = fastdllm.load(str(folder), dtype="float32")
    assert {eos, first, second} <= set(model.stop_token_ids)
    out = fastdllm.generate(model, [prompt], config=config)
    assert out.num_tokens[0] == min(free.index(first), free.index(second))
