"""GGUF files written by llama.cpp's own converter load as the checkpoints they were made from.

The files in `tests/fixtures/gguf/` are our tiny LLaDA, Dream and RND1 checkpoints (the seeded models
of `conftest`) converted by llama.cpp's `convert_hf_to_gguf.py` (`tests/reference/gguf_convert.py`)
at F32, F16 and Q8_0; `manifest.json` records the digest of the weights each was made from, so a
change of those models fails here and asks for the files to be made again. To make them again,
with the llama.cpp source (llama-cpp-python's source distribution on PyPI, vendor/llama.cpp) and an
interpreter with what its converter pins (torch, transformers, sentencepiece, gguf):

    FASTDLLM_RECORD_FIXTURES=1 FASTDLLM_GGUF_CONVERTER=.../vendor/llama.cpp FASTDLLM_GGUF_PYTHON=PY \\
        python -m pytest -q tests/test_gguf.py
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import fastdllm
from fastdllm.evaluation.tasks import get_task
from fastdllm.models.loading import save_pretrained
from tests.test_reference import weights_digest

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures" / "gguf"
MANIFEST = FIXTURES / "manifest.json"
CONVERTER = os.environ.get("FASTDLLM_GGUF_CONVERTER")
CONVERTER_PYTHON = os.environ.get("FASTDLLM_GGUF_PYTHON")
RECORD = os.environ.get("FASTDLLM_RECORD_FIXTURES") == "1"
OUTTYPES = ("f32", "f16", "q8_0")
CORPUS = [
    "Question: Tom has 5 apples and buys 3 more. How many apples does he have?",
    "héllo wörld — 12345 67 !!  \n\n\tx  y",
    "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>",
    "don't won't I'll we've   trailing spaces   ",
]


@pytest.fixture(scope="module", params=["tiny_llada", "tiny_dream", "tiny_rnd1"])
def checkpoint(request, tokenizer, tmp_path_factory):
    """(name, the model, its folder, {outtype: the GGUF file llama.cpp's converter made of it})."""
    name = request.param
    model = request.getfixturevalue(name)
    folder = save_pretrained(model, tmp_path_factory.mktemp(name), tokenizer, dtype=torch.float32)
    digest = weights_digest(folder)
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.is_file() else {}
    files = {}
    for outtype in OUTTYPES:
        path = FIXTURES / f"{name}-{outtype}.gguf"
        if CONVERTER and CONVERTER_PYTHON:
            if not RECORD:
                path = folder.parent / path.name
            run = subprocess.run(
                [
                    CONVERTER_PYTHON,
                    str(HERE / "reference" / "gguf_convert.py"),
                    CONVERTER,
                    str(folder),
                    outtype,
                    str(path),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert run.returncode == 0, run.stderr[-2000:]
            if RECORD:
                manifest[path.name] = {"weights_sha256": digest, "outtype": outtype}
                MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        else:
            assert manifest.get(path.name, {}).get("weights_sha256") == digest, (
                f"{path.name}: made from other weights than {name}'s; make it again (see this module's docstring)"
            )
        files[outtype] = path
    return name, model, folder, files


def test_the_tokenizer_encodes_as_the_one_it_was_converted_from(checkpoint, tokenizer):
    """Every text of a corpus (the arith problems among them) to the same ids; control tokens are
    special; a BOS is added where the file says so (LLaDA's converter always does)."""
    name, _, _, files = checkpoint
    _, tok = fastdllm.load(str(files["f32"]), dtype="float32")
    texts = CORPUS + [
        tokenizer.decode(get_task("arith").encode(tokenizer, d, [])) for d in get_task("arith").load(limit=50)
    ]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == tokenizer.decode(tokenizer.encode(text))
    ids = tok.encode("hi")
    if name == "tiny_llada":
        assert ids[0] == tokenizer.token_to_id(tokenizer.bos_token) and ids[1:] == tokenizer.encode("hi")
    assert tok.chat_template == tokenizer.chat_template
    assert tok.eos_token_id == tokenizer.eos_token_id and tok.stop_token_ids() == tokenizer.stop_token_ids()


def test_float_files_give_the_checkpoints_logits_and_answers(checkpoint, tokenizer):
    """F32: the same weights, logits and greedy answers as the safetensors checkpoint; F16: its
    weights rounded to half precision; Q8_0: within its format's error (8 bits per weight in blocks
    of 32 with a half-precision scale)."""
    name, model, folder, files = checkpoint
    ids = torch.tensor([tokenizer.encode(CORPUS[0])])
    want = model(ids)
    config = fastdllm.GenerationConfig.for_model(model, gen_length=16, block_length=8, stop_at_eos=False)
    prompts = [tokenizer.encode(t) for t in CORPUS[:2]]
    answers = fastdllm.generate(model, prompts, config=config).sequences
    for outtype, path in files.items():
        loaded, _ = fastdllm.load(str(path), dtype="float32")
        assert loaded.family.name == model.family.name and loaded.args.mask_token_id == model.args.mask_token_id
        got = loaded(ids)
        if outtype == "f32":
            for key, p in model.state_dict().items():
                assert torch.equal(p, loaded.state_dict()[key]), key
            assert torch.equal(got, want)
            assert torch.equal(fastdllm.generate(loaded, prompts, config=config).sequences, answers)
        elif outtype == "f16":
            for key, p in model.state_dict().items():  # norms, biases, a router: kept in float32
                assert torch.equal(p.half().float(), loaded.state_dict()[key]) or torch.equal(
                    p, loaded.state_dict()[key]
                ), key
            assert (got - want).abs().max() < 1e-2 * want.abs().max()
        else:
            assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()


def test_the_cli_generates_from_a_gguf_file(checkpoint, capsys):
    from fastdllm.cli.main import main as cli

    _, _, _, files = checkpoint
    argv = ["generate", "--model", str(files["q8_0"]), "--gen-length", "8", "--block-length", "8", "--json", "hi"]
    assert cli(argv) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] <= 8


def test_a_file_we_cannot_read_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        fastdllm.load(str(bad))
    other = tmp_path / "llama.gguf"
    writer = GGUFWriter(str(other), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture 'llama'"):
        fastdllm.load(str(other))


def test_our_export_is_what_llama_cpps_converter_writes(checkpoint, tokenizer, tmp_path):
    """`write_gguf` at F32: the converter's tensors, byte for byte and type for type, and its
    metadata but for the descriptive `general.*` keys it guesses from names and our tokenizer's
    own BOS flag (LLaDA's converter always sets it)."""
    from gguf import GGUFReader

    from fastdllm.models.gguf import write_gguf

    name, model, _, files = checkpoint
    ours = GGUFReader(str(write_gguf(model, tokenizer, tmp_path / "ours.gguf", "f32")))
    theirs = GGUFReader(str(files["f32"]))
    mine, converted = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(mine) == set(converted)
    for key, t in converted.items():
        assert mine[key].tensor_type == t.tensor_type and mine[key].data.tobytes() == t.data.tobytes(), key
    descriptive = {"general.basename", "general.finetune", "general.organization", "general.size_label"}
    descriptive |= {"general.sampling.temp", "general.name", "GGUF.kv_count"}
    for key, field in theirs.fields.items():
        if key in descriptive:
            continue
        assert key in ours.fields, key
        if key != "tokenizer.ggml.add_bos_token":
            assert ours.fields[key].contents() == field.contents(), key


@pytest.mark.parametrize("kind, step", [("f16", 2**-11), ("bf16", 2**-8), ("q8_0", 1 / 127), ("q4_0", 1 / 8)])
def test_an_exported_file_loads_back_within_its_formats_error(tiny_dream, tokenizer, tmp_path, kind, step):
    """Each matrix within its format's rounding (F16: half an ulp; Q8_0 and Q4_0: a block's scale,
    its largest weight over 127 or 8, at most the matrix's), vectors exact, the tokenizer the same."""
    from fastdllm.models.gguf import write_gguf

    path = write_gguf(tiny_dream, tokenizer, tmp_path / f"dream-{kind}.gguf", kind)
    loaded, tok = fastdllm.load(str(path), dtype="float32")
    for name, w in tiny_dream.state_dict().items():
        got = loaded.state_dict()[name]
        if w.dim() == 1:
            assert torch.equal(got, w), name
        else:
            assert (got - w).abs().max() <= step * w.abs().max() * 1.0001, name
    assert tok.encode(CORPUS[1]) == tokenizer.encode(CORPUS[1])


def test_the_cli_exports_gguf_and_refuses_what_gguf_cannot_take(tiny_llada_dir, tmp_path, capsys):
    from fastdllm.cli.main import main as cli

    out = tmp_path / "tiny.gguf"
    assert cli(["quantize", str(tiny_llada_dir), str(out), "--bits", "8", "--format", "gguf"]) == 0
    assert "Q8_0" in capsys.readouterr().out and fastdllm.load(str(out))[0].family.name == "LLaDA"
    assert cli(["quantize", str(tiny_llada_dir), str(tmp_path / "x"), "--bits", "16"]) == 2
    assert "bits:" in capsys.readouterr().err
    assert (
        cli(["quantize", str(tiny_llada_dir), str(out), "--bits", "4", "--format", "gguf", "--group-size", "64"]) == 2
    )
    assert "group_size:" in capsys.readouterr().err


LLAMA_CPP_BIN = os.environ.get("FASTDLLM_LLAMA_CPP_BIN")  # a llama.cpp build's bin/


@pytest.mark.slow
@pytest.mark.skipif(
    not (LLAMA_CPP_BIN and Path(LLAMA_CPP_BIN, "llama-diffusion-cli").is_file()),
    reason="set FASTDLLM_LLAMA_CPP_BIN to a llama.cpp build's bin/ (llama-diffusion-cli, llama-tokenize)",
)
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_llama_cpp_runs_our_export_of_the_embedded_model(tmp_path, kind):
    """The embedded model exported here: llama.cpp's tokenizer gives our ids for its chat prompt, and
    its diffusion example (LLaDA's low-confidence schedule, greedy) answers an arith problem right."""
    from fastdllm.models.gguf import write_gguf

    model, tok = fastdllm.load(None, dtype="float32")
    path = write_gguf(model, tok, tmp_path / f"arith-{kind}.gguf", kind)
    task = get_task("arith")
    doc = task.load(limit=1)[0]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(tok.decode(task.encode(tok, doc, []), skip_special_tokens=False))
    run = subprocess.run(
        [f"{LLAMA_CPP_BIN}/llama-tokenize", "-m", str(path), "-f", str(prompt), "--ids", "--log-disable"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == task.encode(tok, doc, [])
    question = f"Question: {doc.data['question']}\nAnswer:"  # its chat template from the file
    run = subprocess.run(
        [f"{LLAMA_CPP_BIN}/llama-diffusion-cli", "-m", str(path), "-p", question, "-ub", "128", "-b", "128"]
        + ["-c", "128", "--diffusion-steps", "64", "--diffusion-block-length", "32", "--temp", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"#### {doc.gold}" in run.stdout + run.stderr


def test_plan_reads_a_gguf_and_says_it_is_dequantized(checkpoint, capsys):
    from fastdllm.cli.main import main as cli

    _, model, _, files = checkpoint
    assert cli(["plan", "--model", str(files["q8_0"]), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Q8_0" in out and "dequantized at load" in out
    assert cli(["plan", "--model", str(files["q8_0"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind, quantize", [("q8_0", "int8"), ("q4_0", "int4")])
def test_q8_0_and_q4_0_blocks_become_our_int8_and_int4_layers(tiny_llada, tokenizer, tmp_path, kind, quantize):
    """`quantize=` on a GGUF of that format takes its blocks as they are (groups of 32, its float16
    scales): each layer's weight is exactly the file's, and no second rounding happens."""
    from fastdllm.models.gguf import quantized_weights, write_gguf

    path = write_gguf(tiny_llada, tokenizer, tmp_path / f"tiny-{kind}.gguf", kind)
    floats, _ = fastdllm.load(str(path), dtype="float32")
    held, _ = fastdllm.load(str(path), dtype="float32", quantize=quantize)
    assert held.quantization["group_size"] == [32] and held.quantization["bits"] == [int(quantize[3:])]
    blocks = quantized_weights(path, floats, int(quantize[3:]))
    assert blocks and set(blocks) == {n for n, m in held.named_modules() if type(m).__name__ == "QuantizedLinear"}
    for name, qw in blocks.items():
        assert torch.equal(qw.dequantize(torch.float32), floats.get_submodule(name).weight), name
    ids = torch.tensor([tokenizer.encode(CORPUS[0])])
    want = floats(ids)  # the same weights: only the kernels' bfloat16 activations differ
    assert (held(ids) - want).abs().max() < 0.02 * want.abs().max()
    with pytest.raises(ValueError, match="^group_size: "):
        fastdllm.load(str(path), dtype="float32", quantize=quantize, group_size=64)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_the_embedded_models_answers_are_unchanged_from_gguf(tmp_path, kind):
    """The embedded model written as a GGUF (at F32 llama.cpp's converter's tensors, byte for byte)
    and loaded back: its greedy answers to 32 held-out arith problems are the safetensors model's."""
    from fastdllm.models.gguf import write_gguf

    model, tok = fastdllm.load(None, dtype="float32")
    loaded, gtok = fastdllm.load(str(write_gguf(model, tok, tmp_path / f"arith-{kind}.gguf", kind)), dtype="float32")
    task = get_task("arith")
    prompts = [task.encode(tok, d, []) for d in task.load(limit=32)]
    assert [task.encode(gtok, d, []) for d in task.load(limit=32)] == prompts
    config = fastdllm.GenerationConfig.for_model(model, gen_length=128)
    want = fastdllm.generate(model, prompts, config=config).sequences
    assert torch.equal(fastdllm.generate(loaded, prompts, config=config).sequences, want)
