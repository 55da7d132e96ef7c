"""GGUF files (llama.cpp's format) in and out: the model, its tokenizer and its chat template,
read and written with the `gguf` package.

A file of an architecture llama.cpp writes for a family we run (`ARCHITECTURES`: LLaDA, Dream,
RND1, whose experts llama.cpp stacks as we do) becomes the family's model (its sizes from the
file's metadata) and state dict (llama.cpp's tensor names mapped onto ours). Every tensor is
dequantized at load by `gguf.quants` (F32, F16 and BF16 exactly; Q8_0, Q4_0, the K-quants to
float32 within their format's error), then held in the dtype asked for; with `quantize=` a Q8_0
or Q4_0 file's own blocks become our int8 / int4 layers (`quantized_weights`). LLaDA's converter
permutes the rows of q and k for llama.cpp's interleaved RoPE (`LLaDAModel.permute`); that
permutation is undone here (and done again by `write_gguf`).

The tokenizer is rebuilt from the file's vocabulary, merges and token types, with the pre-tokenizer
its `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`): the same token ids for every text as the
tokenizer the file was converted from, control tokens special as there, and a BOS added where the
file says `add_bos_token` (llama.cpp adds it then; LLaDA's converter always says so)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import BPE

from ..text.tokenizer import QWEN2_PATTERN, Tokenizer
from . import FAMILIES
from .transformer import ModelArgs

# llama.cpp's architecture name -> our family's model_type
ARCHITECTURES = {"llada": "llada", "dream": "dream", "rnd1": "rnd1"}

# llama.cpp's tensor names -> ours ({i}: the layer)
TOP = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
LAYER = {
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_gate_inp.weight": "feed_forward.router.weight",  # a mixture of experts' (RND1's), stacked as ours
    "ffn_gate_exps.weight": "feed_forward.w1",
    "ffn_up_exps.weight": "feed_forward.w3",
    "ffn_down_exps.weight": "feed_forward.w2",
}

# `tokenizer.ggml.pre` -> how text is split before the byte-level BPE (llama.cpp's regexes)
LLAMA3_PATTERN = (  # as Llama 3's tokenizer.json writes it
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"gpt-2": None, "qwen2": QWEN2_PATTERN, "llama-bpe": LLAMA3_PATTERN}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


class GGUFFile:
    """A GGUF file's metadata and tensors (`gguf.GGUFReader`, memory-mapped)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # its reader raises ValueError or struct errors on a bad file
            raise ValueError(f"{path}: not a GGUF file this reader can read ({e})") from None
        self.path = path
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def hp(self, key: str, default=None):
        """An architecture's hyperparameter (`{arch}.{key}`)."""
        return self.get(f"{self.arch}.{key}", default)

    def tensor(self, t) -> torch.Tensor:
        from gguf.quants import dequantize

        return torch.from_numpy(
            np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        )  # a copy: the file is mapped read-only


def is_gguf(path) -> bool:
    return path is not None and str(path).lower().endswith(".gguf") and Path(path).is_file()


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's LLaDA permutation of q/k rows (per head: halves interleaved for its RoPE)."""
    shape = w.shape
    return w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _permuted_heads(arch: str, name: str, args: ModelArgs) -> int | None:
    """The heads whose rows llama.cpp's converter permutes in tensor `name` (LLaDA's q and k), or
    None: the rows are ours as they are."""
    if arch != "llada":
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return args.n_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return args.n_kv_heads
    return None


def _gguf_names(args: ModelArgs) -> dict[str, str]:
    """Our parameter name -> llama.cpp's tensor name."""
    names = {v: k for k, v in TOP.items()}
    names.update({f"layers.{i}.{v}": f"blk.{i}.{k}" for i in range(args.n_layers) for k, v in LAYER.items()})
    return names


def read_args(f: GGUFFile) -> tuple[str, ModelArgs]:
    """(model_type, ModelArgs) of the file: its family's fixed fields, sizes from its metadata."""
    if f.arch not in ARCHITECTURES:
        raise ValueError(
            f"{f.path}: general.architecture {f.arch!r} is not one we run from GGUF "
            f"(we read {', '.join(ARCHITECTURES)})"
        )
    model_type = ARCHITECTURES[f.arch]
    family = FAMILIES[model_type]
    reference = family.args_from_config(family.reference_config)
    tensors = {t.name: [int(n) for n in t.shape] for t in f.reader.tensors}
    embd = tensors["token_embd.weight"]
    vocab, dim = int(embd[1]), int(embd[0])  # GGUF lists a matrix's columns first
    n_heads = int(f.hp("attention.head_count"))
    key_length = f.hp("attention.key_length")
    fields = dict(
        dim=dim,
        n_layers=int(f.hp("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(f.hp("attention.head_count_kv", n_heads)),
        hidden_dim=int(f.hp("feed_forward_length", 0) or reference.hidden_dim),
        vocab_size=vocab,
        max_seq_len=int(f.hp("context_length", reference.max_seq_len)),
        rope_theta=float(f.hp("rope.freq_base", reference.rope_theta)),
        norm_eps=float(f.hp("attention.layer_norm_rms_epsilon", reference.norm_eps)),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_embeddings="output.weight" not in tensors,
        mask_token_id=int(f.get("tokenizer.ggml.mask_token_id", reference.mask_token_id)),
        eos_token_id=int(f.get("tokenizer.ggml.eos_token_id", reference.eos_token_id)),
        shifted_logits=family.shifted_logits,
        head_size=int(key_length) if key_length and int(key_length) != dim // n_heads else 0,
    )
    if f.hp("expert_count"):
        fields.update(
            n_experts=int(f.hp("expert_count")),
            n_active_experts=int(f.hp("expert_used_count")),
            moe_hidden_dim=int(f.hp("expert_feed_forward_length")),
        )
    args = {**reference.__dict__, **fields, **family.fixed}
    return model_type, ModelArgs(**{k: v for k, v in args.items() if k in ModelArgs.__dataclass_fields__})


def read_config(f: GGUFFile) -> tuple[str, ModelArgs, dict]:
    """(model_type, ModelArgs, the family's config.json) the file's metadata describes, with its
    own BOS and pad ids (RND1's closing pad is its pad) and its float type as `torch_dtype`."""
    model_type, args = read_args(f)
    config = FAMILIES[model_type].config_from_args(args)
    for key, theirs in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f.get(f"tokenizer.ggml.{theirs}") is not None:
            config[key] = int(f.get(f"tokenizer.ggml.{theirs}"))
    config["torch_dtype"] = str(file_dtype(f)).removeprefix("torch.")  # what `--dtype auto` starts from
    return model_type, args, config


def config_of_gguf(path: Path) -> dict:
    """The family config.json a GGUF file's metadata describes (`fastdllm plan`), with its tensor
    types under `gguf_tensor_types`: every one is dequantized at load."""
    f = GGUFFile(path)
    config = read_config(f)[2]
    config["gguf_tensor_types"] = sorted({t.tensor_type.name for t in f.reader.tensors})
    config["torch_dtype"] = str(file_dtype(f)).removeprefix("torch.")  # what `load`'s "auto" reads
    return config


def read_tokenizer(f: GGUFFile) -> Tokenizer:
    """The file's tokenizer: a byte-level BPE of its vocabulary and merges (`tokenizer.ggml.model`
    "gpt2"), split as its `tokenizer.ggml.pre` says."""
    kind, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ValueError(f"{f.path}: tokenizer.ggml.model {kind!r}: only byte-level BPE ('gpt2') is read")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not one we rebuild ({', '.join(PRE_TOKENIZERS)})")
    tokens, types = list(f.get("tokenizer.ggml.tokens")), list(f.get("tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
    fast = FastTokenizer(
        BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    pattern = PRE_TOKENIZERS[pre]
    if pattern is None:
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        fast.normalizer = normalizers.NFC() if pre == "qwen2" else None
        fast.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    fast.decoder = decoders.ByteLevel()
    for token, kind in zip(tokens, types):
        if kind in (CONTROL, USER_DEFINED):
            fast.add_tokens([AddedToken(token, special=kind == CONTROL, normalized=False)])
    config: dict = {}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("mask", "mask_token")):
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            config[name] = tokens[int(i)]
    template = f.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    if f.get("tokenizer.ggml.add_bos_token") and "bos_token" in config:
        bos = config["bos_token"]
        fast.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, fast.token_to_id(bos))]
        )
        config["add_bos_token"] = True
    return Tokenizer(fast, config)


def read_state(f: GGUFFile, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state dict from the file's tensors, each dequantized, in `dtype`."""
    state = {}
    for t in f.reader.tensors:
        name = t.name
        if name in TOP:
            ours = TOP[name]
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest not in LAYER:
                raise ValueError(f"{f.path}: tensor {name!r} is not one of the {f.arch} layers we read")
            ours = f"layers.{i}.{LAYER[rest]}"
        elif name == "rope_freqs.weight":
            continue  # RoPE's frequencies come from rope_theta
        else:
            raise ValueError(f"{f.path}: tensor {name!r} is not one we read")
        w, heads = f.tensor(t), _permuted_heads(f.arch, name, args)
        state[ours] = (w if heads is None else _unpermute(w, heads)).to(dtype)
    return state


def file_dtype(f: GGUFFile) -> torch.dtype:
    """The dtype its float weights are stored in (the matrices'; quantized ones compute in float32)."""
    kinds = {t.tensor_type.name for t in f.reader.tensors if len(t.shape) > 1}
    for name, dtype in (("BF16", torch.bfloat16), ("F16", torch.float16)):
        if kinds == {name}:
            return dtype
    return torch.float32


# --- out: what llama.cpp's converter writes for these families, from our model -----------------
# `fastdllm quantize --format gguf`'s types: the matrices' storage (norms and biases stay F32)
WRITE_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
}
NORMAL, UNUSED = 1, 5


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LLaDA layout of q/k rows (`LLaDAModel.permute`), the inverse of `_unpermute`."""
    shape = w.shape
    return w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _pre_tokenizer_name(fast: FastTokenizer) -> str:
    """The `tokenizer.ggml.pre` that splits text as `fast` does; a ValueError where none does."""
    import json

    pre = json.loads(fast.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel":
        pattern = parts[0].get("pattern", {}).get("Regex")
        for name, known in PRE_TOKENIZERS.items():
            if known is not None and pattern == known:
                return name
    raise ValueError("format: this tokenizer's pre-tokenizer has no llama.cpp name (gpt-2, qwen2, llama-bpe)")


def _vocabulary(tokenizer: Tokenizer, size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges) of a byte-level BPE tokenizer, padded to `size` as
    llama.cpp's converter pads a vocabulary smaller than the model's."""
    import json

    fast = tokenizer.fast
    model = json.loads(fast.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError("format: gguf export needs a byte-level BPE tokenizer")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    added = {t.content: t.special for t in fast.get_added_tokens_decoder().values()}
    by_id = {i: t for t, i in fast.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        else:
            tokens.append(token)
            types.append(NORMAL if token not in added else CONTROL if added[token] else USER_DEFINED)
    return tokens, types, merges


def _write_tokenizer(w, tokenizer: Tokenizer, vocab_size: int) -> None:
    """The tokenizer's part of the metadata: vocabulary, types, merges, pre-tokenizer, special ids,
    BOS flag and chat template, as the converter writes them."""
    tokens, types, merges = _vocabulary(tokenizer, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer_name(tokenizer.fast))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for add, token in ((w.add_bos_token_id, tokenizer.bos_token), (w.add_eos_token_id, tokenizer.eos_token)):
        if tokenizer.id_of(token) is not None:
            add(tokenizer.id_of(token))
    if tokenizer.pad_token_id is not None:
        w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(bool(tokenizer.config.get("add_bos_token")))
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)


def write_gguf(model, tokenizer: Tokenizer, path, kind: str = "f16") -> Path:
    """Write `model` (LLaDA, Dream or RND1) and its tokenizer as the GGUF llama.cpp's converter writes
    for that family, its matrices stored as `kind` (`WRITE_TYPES`; a matrix whose rows the format's
    blocks do not divide is stored as F16, and a router in F32, as the converter does)."""
    import gguf
    from gguf.quants import quantize

    ours = {v: k for k, v in ARCHITECTURES.items()}
    family = getattr(model, "family", None)
    if family is None or family.model_type not in ours:
        raise ValueError(f"format: gguf export is for {', '.join(ARCHITECTURES)} models")
    if kind not in WRITE_TYPES:
        raise ValueError(f"format: gguf type {kind!r} is not one of {', '.join(WRITE_TYPES)}")
    if getattr(model, "quantization", None) is not None:
        raise ValueError("format: export a full-precision model to gguf (its weights are quantized in memory)")
    arch, a = ours[family.model_type], model.args
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(Path(str(getattr(model, "name_or_path", "model"))).name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.hidden_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
    if a.n_experts:  # as its converter writes a Qwen2-MoE-shaped model (RND1)
        w.add_expert_count(a.n_experts)
        w.add_expert_used_count(a.n_active_experts)
        w.add_expert_feed_forward_length(a.moe_hidden_dim)
    if a.n_experts or (a.head_size and a.head_size != a.dim // a.n_heads):
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
    if arch == "llada":  # as its converter writes them
        w.add_vocab_size(a.vocab_size)
        w.add_rope_dimension_count(a.head_dim)
    w.add_causal_attention(False)
    w.add_diffusion_shift_logits(a.shifted_logits)
    w.add_mask_token_id(a.mask_token_id)
    _write_tokenizer(w, tokenizer, a.vocab_size)
    names = _gguf_names(a)
    qtype = gguf.GGMLQuantizationType[WRITE_TYPES[kind]]
    for name, tensor in model.state_dict().items():
        if name not in names:
            raise ValueError(f"format: {name} has no place in a {arch} GGUF")
        t, theirs = tensor.detach().float().cpu(), names[name]
        heads = _permuted_heads(arch, theirs, a)
        data = (t if heads is None else _permute(t, heads)).numpy()
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32 or theirs.endswith("ffn_gate_inp.weight"):
            w.add_tensor(theirs, data)
            continue
        try:
            stored, stored_type = quantize(data, qtype), qtype
        except gguf.QuantError:  # rows the format's blocks do not divide
            stored, stored_type = quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16
        w.add_tensor(theirs, stored, raw_dtype=stored_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- Q8_0 / Q4_0 blocks as our int8 / int4 layers ----------------------------------------------
# llama.cpp's block of 32 weights: a float16 scale d, then the values; Q8_0 w = d q (q int8),
# Q4_0 w = d (q - 8) (q in 0..15, element j in the low nibble of byte j, j + 16 in its high one).
BLOCK_BITS = {"Q8_0": 8, "Q4_0": 4}


def _blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (out, in) int8 in the signed range, scale (out, in / 32) float32) of a Q8_0 or Q4_0
    tensor, exactly as llama.cpp stores them."""
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # (out, blocks * bytes per block)
    rows, kind = raw.shape[0], t.tensor_type.name
    size = 34 if kind == "Q8_0" else 18
    blocks = raw.view(rows, -1, size)
    scale = blocks[..., :2].contiguous().view(torch.float16).view(rows, -1).float()
    if kind == "Q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).view(rows, -1)
    else:
        packed = blocks[..., 2:].to(torch.int16)
        values = (torch.cat([packed & 0xF, packed >> 4], -1) - 8).to(torch.int8).view(rows, -1)
    return values, scale


def quantized_weights(path: Path, model, bits: int, include_head: bool = False) -> dict | None:
    """Our module name -> `QuantizedWeight` of the file's own blocks, for every linear layer
    `quantize=` would quantize, where each is stored as the `bits`' block format (Q8_0 for 8, Q4_0
    for 4: symmetric, groups of 32, the scales as stored); None where one is not (the layers are
    then quantized from the dequantized weights)."""
    from ..quant.linear import quantizable_linears
    from ..quant.weights import QuantizedWeight

    f = GGUFFile(path)
    theirs = _gguf_names(model.args)
    tensors = {t.name: t for t in f.reader.tensors}
    out = {}
    for name in quantizable_linears(model, include_head):
        t = tensors.get(theirs.get(f"{name}.weight", ""))
        if t is None or BLOCK_BITS.get(t.tensor_type.name) != bits:
            return None
        values, scale = _blocks(t)
        heads = _permuted_heads(f.arch, t.name, model.args)
        if heads is not None:  # its rows back in our order
            values, scale = _unpermute(values, heads), _unpermute(scale, heads)
        out[name] = QuantizedWeight(values, scale.to(model.dtype), None, bits, 32)
    return out
