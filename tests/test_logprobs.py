"""Token log-probabilities (`GenerationConfig.logprobs`): each generated token's, from the forward
that wrote it, and the most likely tokens there."""

from __future__ import annotations

import math

import pytest
import torch

import fastdllm
from fastdllm import GenerationConfig, generate

QUESTION = "A cup costs 4 dollars. Zoe buys 3 cups and gets 5 dollars off. How much does Zoe pay?"


@pytest.fixture(scope="module")
def embedded():
    return fastdllm.load(dtype="float32")


def test_each_logprob_is_the_forward_that_revealed_it(embedded):
    """Greedy, every forward over the whole sequence: a token's log-probability is the
    log-softmax of a full forward over the canvas as it was before the step that revealed it, and
    its top tokens are that forward's most likely ones (the revealed token first)."""
    model, tok = embedded
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    config = GenerationConfig(gen_length=64, block_length=32, cache="none", threshold=0.9, logprobs=3)
    canvases = [torch.full((64,), model.mask_token_id)]
    out = generate(model, [prompt], config, on_step=lambda e: e.kind == "step" and canvases.append(e.canvas[0].clone()))
    steps, logprobs, tops = out.unmask_step[0].tolist(), out.logprobs[0], out.top_logprobs[0]
    checked = 0
    for j, s in enumerate(steps):
        if s < 0:  # a stop token's padding, no forward chose it
            assert logprobs[j] is None and tops[j] is None
            continue
        x = torch.cat([torch.tensor(prompt), canvases[s]])[None]
        with torch.inference_mode():
            full = model(x)[0, len(prompt) + j].float().log_softmax(-1)
        token = int(out.sequences[0, j])
        assert math.isclose(logprobs[j], full[token].item(), abs_tol=1e-4), (j, s)
        assert [t for t, _ in tops[j]] == full.topk(3).indices.tolist() and tops[j][0][0] == token
        checked += 1
    assert checked > 10 and len({s for s in steps if s >= 0}) > 1  # several steps, several forwards


def test_logprobs_follow_the_sampling_and_leave_the_tokens_alone(embedded):
    """At temperature > 0 they are those of softmax(logits / temperature) (flatter at 2 than the
    greedy ones); asking for them changes no token; fixed tokens have none."""
    model, tok = embedded
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    base = GenerationConfig(gen_length=32, block_length=32, seed=0, temperature=0.5, fixed={0: (288,)})
    plain, asked = generate(model, [prompt], base), generate(model, [prompt], base.replace(logprobs=0))
    assert torch.equal(plain.sequences, asked.sequences) and plain.logprobs is None
    assert asked.logprobs[0][0] is None  # the fixed token
    assert all(t is None or t == [] for t in asked.top_logprobs[0])
    greedy = generate(model, [prompt], GenerationConfig(gen_length=32, block_length=32, logprobs=0))
    hot = generate(
        model, [prompt], GenerationConfig(gen_length=32, block_length=32, temperature=2.0, seed=0, logprobs=0)
    )
    assert all(v is None or v <= 0 for v in hot.logprobs[0])
    mean = lambda out: sum(v for v in out.logprobs[0] if v is not None) / len(out.logprobs[0])  # noqa: E731
    assert mean(hot) < mean(greedy)
    with pytest.raises(ValueError, match="^logprobs: "):
        GenerationConfig(logprobs=21)


@pytest.mark.parametrize("preset", ["d3llm", "dmax", pytest.param("baseline", marks=pytest.mark.slow)])
def test_every_decoder_reports_them(embedded, preset):
    """Multi-block decoding (tokens written ahead in later blocks) and token editing (a token
    rewritten) report the forward that wrote each final token."""
    model, tok = embedded
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    config = GenerationConfig.preset(preset, gen_length=64, logprobs=2)
    out = generate(model, [prompt], config)
    assert torch.equal(out.sequences, generate(model, [prompt], config.replace(logprobs=None)).sequences)
    written = [lp for lp, s in zip(out.logprobs[0], out.unmask_step[0].tolist()) if s >= 0]
    assert written and all(lp is not None and lp <= 0 for lp in written)


def test_a_batch_reports_each_row_as_alone(embedded):
    model, tok = embedded
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in (QUESTION, "A hat costs 3 dollars.")]
    config = GenerationConfig(gen_length=32, block_length=32, logprobs=1)
    together = generate(model, prompts, config)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], config)
        assert together.sequences[i].tolist() == alone.sequences[0].tolist()
        pairs = zip(together.logprobs[i], alone.logprobs[0])
        assert all((a is None) == (b is None) and (a is None or abs(a - b) < 1e-4) for a, b in pairs)


@pytest.fixture(scope="module")
def server(embedded):
    from .test_server import LiveServer

    model, tok = embedded
    live = LiveServer(model, tok)
    yield live
    live.stop()


def test_the_server_reports_them_through_the_official_client(server, embedded):
    """Chat (`logprobs` + `top_logprobs`) and completions (`logprobs: k`), whole and streamed, with
    n = 2: one entry per answer token, the same whole and streamed, and the engine's own."""
    from .test_server import MODEL

    model, tok = embedded
    messages = [{"role": "user", "content": QUESTION}]
    whole = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, logprobs=True, top_logprobs=2, n=2, seed=0
    )
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert "".join(c.token for c in content) == choice.message.content
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    config = GenerationConfig(gen_length=64, block_length=32, logprobs=2)
    engine = generate(model, [tok.encode_chat(messages)], config)
    assert [c.logprob for c in content] == pytest.approx(engine.logprobs[0][: len(content)], abs=1e-5)
    assert [c.logprob for c in whole.choices[1].logprobs.content] == pytest.approx([c.logprob for c in content])
    streamed = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, logprobs=True, top_logprobs=2, stream=True, seed=0
    )
    pieces = [c for chunk in streamed for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in pieces] == [c.token for c in content]
    assert [c.logprob for c in pieces] == pytest.approx([c.logprob for c in content])
    plain = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content

    prompt = tok.encode_chat(messages)
    comp = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, logprobs=3)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(t) == 3 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.token_logprobs == pytest.approx([c.logprob for c in content], abs=1e-5)
    streamed = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, logprobs=3, stream=True)
    tokens = [t for chunk in streamed for ch in chunk.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert tokens == lp.tokens


def test_filtered_alternatives_are_finite_json_whole_and_streamed(server):
    """Alternatives that top_p, top_k or a JSON schema filtered out have no probability: they are
    reported at the documented floor (vLLM's -9999.0), never -inf, which JSON cannot carry (a 500
    whole, `-Infinity` streamed, which JavaScript's parser rejects)."""
    import json

    import httpx

    from fastdllm.config import LOGPROB_FLOOR

    from .test_server import MODEL

    messages = [{"role": "user", "content": QUESTION}]
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    cases = [
        ("chat", dict(messages=messages, logprobs=True, top_logprobs=3, temperature=0.7, top_p=0.5, seed=1)),
        ("chat", dict(messages=messages, logprobs=True, top_logprobs=3, temperature=0.7, top_k=2, seed=1)),
        ("completions", dict(prompt=QUESTION, logprobs=3, temperature=0.7, top_p=0.5, seed=1)),
        (
            "chat",
            dict(
                messages=messages,
                logprobs=True,
                top_logprobs=2,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            ),
        ),
    ]
    floors = 0
    for endpoint, body in cases:
        url = f"{server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        for stream in (False, True):
            r = httpx.post(url, json={"model": MODEL, "max_tokens": 32, "stream": stream, **body}, timeout=120)
            assert r.status_code == 200, r.text
            assert "Infinity" not in r.text and "NaN" not in r.text
            docs = (
                [r.json()]
                if not stream
                else [json.loads(x[6:]) for x in r.text.split("\n") if x[6:] not in ("", "[DONE]")]
            )
            for doc in docs:
                for choice in doc["choices"]:
                    lp = choice["logprobs"] or {}
                    tops = [t["logprob"] for c in lp.get("content") or [] for t in c["top_logprobs"]]
                    tops += [v for t in lp.get("top_logprobs") or [] if t for v in t.values()]
                    assert all(LOGPROB_FLOOR <= v <= 0 for v in tops)
                    floors += sum(v == LOGPROB_FLOOR for v in tops)
    assert floors  # the filters really left alternatives without probability
    for endpoint, body in cases:  # and the official client takes every one, whole and streamed
        api = server.client.chat.completions if endpoint == "chat" else server.client.completions
        extra = {k: body.pop(k) for k in ("top_k",) if k in body}
        whole = api.create(model=MODEL, max_tokens=32, extra_body=extra, **body)
        chunks = list(api.create(model=MODEL, max_tokens=32, stream=True, extra_body=extra, **body))
        assert whole.choices[0].logprobs is not None and chunks


def test_a_stop_string_inside_a_token_keeps_tokens_and_text_together(server, embedded):
    """A stop string that starts inside a token cuts the text there: the logprob tokens cover exactly
    the text (the last one is the part of its token that the text keeps), whole and streamed, in
    both endpoints."""
    from .test_server import MODEL

    model, tok = embedded
    messages = [{"role": "user", "content": QUESTION}]
    free = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, logprobs=True)
    pieces = [c.token for c in free.choices[0].logprobs.content]
    k = next(i for i, p in enumerate(pieces) if i > 2 and len(p.strip()) >= 3)
    stop = pieces[k].strip()[1:]  # starts inside token k
    kept = free.choices[0].message.content.split(stop)[0]
    assert not kept.endswith(tuple(pieces[:k]))  # the cut really falls inside a token
    whole = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, logprobs=True, stop=[stop]
    )
    assert whole.choices[0].message.content == kept
    assert "".join(c.token for c in whole.choices[0].logprobs.content) == kept
    streamed = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, logprobs=True, stop=[stop], stream=True
    )
    chunks = list(streamed)
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == kept
    assert "".join(t.token for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content) == kept
    prompt = tok.encode_chat(messages)
    comp = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, logprobs=1, stop=[stop])
    assert comp.choices[0].text == kept and "".join(comp.choices[0].logprobs.tokens) == kept


def test_generate_json_reports_them(capsys):
    from fastdllm.cli import main as cli

    assert cli.main(["generate", "--json", "--logprobs", "2", "--gen-length", "32", QUESTION]) == 0
    import json

    record = json.loads(capsys.readouterr().out)
    assert len(record["logprobs"]) == record["tokens"] > 0
    text, logprob, top = record["logprobs"][0]
    assert record["text"].startswith(text) and logprob <= 0 and len(top) == 2 and top[0][0] == text


def test_raw_logprobs_are_the_models_own(embedded):
    """`logprobs_mode="raw"`: the model's log-softmax, whatever the sampling (vLLM's raw_logprobs);
    the same tokens as processed ones at the same seed."""
    model, tok = embedded
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    base = GenerationConfig(gen_length=32, block_length=32, cache="none", temperature=2.0, seed=0, logprobs=0)
    processed, raw = generate(model, [prompt], base), generate(model, [prompt], base.replace(logprobs_mode="raw"))
    assert torch.equal(processed.sequences, raw.sequences)
    greedy = generate(model, [prompt], base.replace(temperature=0.0, logprobs_mode="raw"))
    assert raw.logprobs[0] != processed.logprobs[0]
    first = [j for j, s in enumerate(raw.unmask_step[0].tolist()) if s == 0]  # revealed by the first forward
    x = torch.cat([torch.tensor(prompt), torch.full((32,), model.mask_token_id)])[None]
    with torch.inference_mode():
        full = model(x)[0, len(prompt) :].float().log_softmax(-1)
    for j in first:
        assert math.isclose(raw.logprobs[0][j], full[j, int(raw.sequences[0, j])].item(), abs_tol=1e-4)
    assert first and greedy.logprobs[0][0] is not None
    with pytest.raises(ValueError, match="^logprobs_mode: "):
        GenerationConfig(logprobs_mode="logits")


def test_a_grammars_rows_report_logprobs_after_its_mask(embedded):
    """Under a JSON schema the processed log-probabilities are renormalised over the tokens the
    grammar allowed at each position: a token it forces has log-probability 0, and none is below
    its raw value; raw ones are the model's."""
    from fastdllm.engine.constraints import response_format_constraint

    model, tok = embedded
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    config = GenerationConfig(gen_length=32, block_length=32, logprobs=0, stop_at_eos=False)
    runs = {}
    for mode in ("processed", "raw"):
        constraint = response_format_constraint(fmt, tok, model.stop_token_ids, budget=32)
        runs[mode] = generate(model, [prompt], config.replace(logprobs_mode=mode), constraints=[constraint])
    assert torch.equal(runs["processed"].sequences, runs["raw"].sequences)
    processed, raw = runs["processed"].logprobs[0], runs["raw"].logprobs[0]
    pairs = [(p, r) for p, r in zip(processed, raw) if p is not None]
    assert pairs and all(p >= r - 1e-5 for p, r in pairs)
    assert any(p == 0.0 and r < -1e-3 for p, r in pairs)  # a token only the grammar allowed
    assert tok.decode(runs["processed"].sequences[0]).startswith("{")
