"""The text-in, text-out API, input validation of generate(), and the CLI's small conveniences."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig, generate, generate_text
from fastdllm.config import ConfigError

from .conftest import REPO


@pytest.fixture(scope="module")
def loaded():
    return fastdllm.load(dtype="float32")


QUESTION = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"


def test_text_api_single_batch_and_chat(loaded):
    model, tok = loaded
    chat = generate_text(model, tok, messages=[{"role": "user", "content": QUESTION}], threshold=0.9)
    assert isinstance(chat, fastdllm.TextOutput) and "####" in chat.text and chat.finish_reason == "stop"
    # the same as generating the templated ids by hand
    out = generate(model, [tok.encode_chat([{"role": "user", "content": QUESTION}])], config=GenerationConfig())
    assert chat.text == tok.decode(out.sequences[0][: chat.num_tokens].tolist())
    many = generate_text(model, tok, messages=[[{"role": "user", "content": QUESTION}]] * 2)
    assert [m.text for m in many] == [chat.text, chat.text]
    plain = generate_text(model, tok, ["Question: " + QUESTION + "\nAnswer:"] * 2, max_new_tokens=10)
    assert len(plain) == 2 and all(p.num_tokens <= 10 for p in plain)


def test_max_new_tokens_rounds_up_to_blocks_and_cuts_back(loaded):
    model, tok = loaded
    r = generate_text(
        model,
        tok,
        messages=[{"role": "user", "content": QUESTION}],
        max_new_tokens=5,
        block_length=8,
        stop_at_eos=False,
    )
    assert r.num_tokens <= 5 and r.finish_reason == "length"
    with pytest.raises(ConfigError) as info:
        generate_text(model, tok, "x", max_new_tokens=0)
    assert info.value.param == "max_new_tokens"
    with pytest.raises(ValueError, match="prompt"):
        generate_text(model, tok)


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("some text", "generate_text"),
        (None, "generate_text"),
        ([1.5, 2.0], "integers"),
        ([[1, 2], [3, "x"]], "integers"),
        ([10**9], "vocabulary"),
        (torch.tensor([[0.5]]), "integers"),
        ([True, 3], "integers"),
    ],
)
def test_generate_rejects_what_is_not_token_ids(loaded, bad, needle):
    model, _ = loaded
    with pytest.raises(ValueError, match=needle):
        generate(model, bad, config=GenerationConfig(gen_length=32))


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(alg="entropy", threshold=None, alg_temp=1e-300), "alg_temp"),
        (dict(alg_temp=float("inf")), "alg_temp"),
        (dict(temperature=1e-300, alg="entropy"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_values_that_would_make_nans_are_rejected(kw, param):
    with pytest.raises(ConfigError) as info:
        GenerationConfig(**kw)
    assert info.value.param == param


@pytest.mark.slow  # two subprocess end-to-end runs
def test_cli_version_and_broken_pipe():
    r = subprocess.run([sys.executable, "-m", "fastdllm", "--version"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == f"fastdllm {fastdllm.__version__}"
    # the reader of stdout goes away before the answer is written: no traceback
    p = subprocess.Popen(
        [sys.executable, "-m", "fastdllm", "generate", "--threads", "1", "--gen-length", "32", QUESTION],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(120)
    assert "Traceback" not in err, err


def test_plain_prompts_carry_the_tokenizers_own_bos(loaded, monkeypatch):
    """Plain text is encoded as `tokenizer(text)` encodes it: with the BOS a tokenizer's
    post-processor adds (as vLLM's /v1/completions and Fast-dLLM's eval_llada.py do), in the text
    API and the evaluation alike; the chat template's own BOS is not doubled."""
    import copy

    from tokenizers import processors

    from fastdllm.engine import textgen
    from fastdllm.evaluation.tasks import get_task

    model, tok = loaded
    tok = copy.deepcopy(tok)
    bos = tok.fast.token_to_id("<|startoftext|>")
    tok.fast.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", bos)]
    )
    task = get_task("arith")
    doc = task.load(limit=1)[0]
    plain = task.encode(tok, doc, [], chat=False)
    assert plain[0] == bos and plain[1:] == tok.encode(task.plain_text(doc, []), add_special_tokens=False)
    assert task.encode(tok, doc, [], chat=True).count(bos) == 1
    seen = []
    monkeypatch.setattr(
        textgen, "generate", lambda m, ids, config, **kw: seen.append(ids) or generate(m, ids, config=config, **kw)
    )
    generate_text(model, tok, QUESTION, max_new_tokens=8)
    assert seen[0][0][0] == bos and seen[0][0][1:] == tok.encode(QUESTION, add_special_tokens=False)
