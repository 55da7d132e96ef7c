"""DiffusionGemma with images against transformers: its image processor (`Gemma4ImageProcessorPil`),
its vision tower (`get_image_features`), the encoder's logits over a prompt holding images (causal,
and with `use_bidirectional_attention="vision"`), and `generate`'s tokens and forwards, on tiny
checkpoints its class made with a vision config (`test_diffusion_gemma.make_reference`)."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import fastdllm

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("transformers without DiffusionGemma (the test extra asks for 5.25)", allow_module_level=True)
PIL = pytest.importorskip("PIL.Image")

from fastdllm.models.gemma_vision import ClippedLinear  # noqa: E402

from .test_diffusion_gemma import CANVAS, in_float64, make_reference  # noqa: E402

BUDGET = 70  # soft tokens per image at most: the smallest budget its processor takes
# Gemma 4's chat template's way with an image part: its image token in place, inline
TEMPLATE = (
    "{%- for m in messages -%}<|turn>{{ m.role }}\n"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for p in m.content -%}"
    "{%- if p.type == 'image' -%}<|image|>{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<turn|>\n{%- endfor -%}{%- if add_generation_prompt -%}<|turn>model\n{%- endif -%}"
)


def with_image_tokens():
    """The test tokenizer with Gemma 4's image tokens and a chat template that writes them."""
    from tokenizers import AddedToken

    from fastdllm.embedded.recipe import build_tokenizer

    tok = build_tokenizer()
    tok.fast.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|image|>", "<|image>", "<image|>")]
    )
    tok.config["chat_template"] = tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def image_tokenizer():
    return with_image_tokens()


def picture(height: int, width: int, seed: int = 0, mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return PIL.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


def processed(images):
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=BUDGET)(images=images, return_tensors="pt")


def image_checkpoint(folder, tokenizer, bidirectional="vision"):
    """A tiny DiffusionGemma with a vision tower that transformers' class made, saved in `folder`
    with the image processor's settings; returns transformers' model."""
    reference = make_reference(tokenizer, folder, seed=1, images=True, bidirectional=bidirectional)
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": BUDGET}}))
    return reference


def made(tmp_path_factory, tokenizer, bidirectional):
    """(transformers' model, ours, folder) in float32, images attending as `bidirectional` says."""
    folder = tmp_path_factory.mktemp("gemma_images")
    reference = image_checkpoint(folder, tokenizer, bidirectional)
    model, _ = fastdllm.load(str(folder), dtype="float32")
    return reference, model, folder


@pytest.fixture(scope="module", params=[None, "vision"], ids=["causal-images", "bidirectional-images"])
def pair(request, tmp_path_factory, image_tokenizer):
    """Both ways an image's tokens may attend: for what the mask decides."""
    return made(tmp_path_factory, image_tokenizer, request.param)


@pytest.fixture(scope="module")
def one(tmp_path_factory, image_tokenizer):
    """Images attending both ways: for what does not depend on the mask."""
    return made(tmp_path_factory, image_tokenizer, "vision")


@pytest.mark.parametrize(
    "size,mode",
    [((40, 60), "RGB"), ((300, 90), "RGB"), ((20, 700), "RGB"), ((64, 64), "RGBA"), ((50, 33), "L")],
    ids=["wide", "tall", "strip", "transparent", "grey"],
)
def test_images_are_processed_as_its_image_processor_does(one, size, mode):
    from fastdllm.models.gemma_vision import patchify, soft_token_count
    from fastdllm.text.images import open_image

    _, model, _ = one
    image = picture(*size, mode=mode)
    theirs = processed([image])
    patches, positions = patchify(open_image(image), model.vision.a)
    n = patches.shape[0]
    assert torch.equal(patches, theirs["pixel_values"][0, :n])
    assert torch.equal(positions, theirs["image_position_ids"][0, :n])
    assert (theirs["image_position_ids"][0, n:] == -1).all()  # the rest is its padding
    assert soft_token_count(open_image(image), model.vision.a) == int(theirs["num_soft_tokens_per_image"][0])


def test_the_vision_tower_gives_its_soft_tokens(one):
    reference, model, _ = one
    for seed, size in enumerate([(40, 60), (300, 90)]):
        image = picture(*size, seed=seed)
        theirs = processed([image])
        with torch.no_grad():
            want = reference.model.encoder.get_image_features(
                theirs["pixel_values"], theirs["image_position_ids"]
            ).pooler_output
        got = model.image_features(image)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def reference_inputs(reference, tokenizer, text: str, images: list) -> tuple[list[int], dict]:
    """A prompt with one placeholder per image before `text`, and transformers' inputs for it:
    the ids its processor places, its pixel values, patch positions and token types."""
    c = reference.config
    theirs = processed(images)
    placed = []
    for n in theirs["num_soft_tokens_per_image"].tolist():
        placed += [c.boi_token_id] + [c.image_token_id] * n + [c.eoi_token_id]
    head, tail = tokenizer.encode("Look:"), tokenizer.encode(text)
    ours = head + [c.image_token_id] * len(images) + tail
    x = torch.tensor([head + placed + tail])
    kwargs = dict(
        pixel_values=theirs["pixel_values"],
        image_position_ids=theirs["image_position_ids"],
        mm_token_type_ids=(x == c.image_token_id).long(),
    )
    return ours, dict(input_ids=x, **kwargs)


def test_a_prompt_with_images_gives_the_encoders_logits(pair, tokenizer):
    reference, model, _ = pair
    images = [picture(40, 60), picture(60, 40, seed=3)]
    ids, theirs = reference_inputs(reference, tokenizer, "what is in the pictures?", images)
    placed, embeds = model.place_images(ids, images)
    assert placed == theirs["input_ids"][0].tolist()
    with torch.no_grad():
        hidden = reference.model.encoder(**theirs).last_hidden_state
        want = reference.lm_head(hidden).float()
        cap = reference.config.text_config.final_logit_softcapping
        want = torch.tanh(want / cap) * cap
        x, n = torch.tensor([placed]), len(placed)
        got = model.head(model._hidden(x, [(0, 0, n, n, n)], None, {0: embeds}))
    assert torch.allclose(got, want[0], atol=1e-4, rtol=1e-4), (got - want[0]).abs().max()


@pytest.fixture(scope="module")
def float64_pair(pair):
    reference, _, folder = pair
    return in_float64(reference, folder)


@pytest.mark.parametrize(
    "cache", ["dual", pytest.param("prefix", marks=pytest.mark.slow), pytest.param("none", marks=pytest.mark.slow)]
)
def test_generate_with_images_gives_transformers_tokens_and_forwards(float64_pair, tokenizer, cache):
    """Two canvases after a prompt with two images: the same tokens and decoder forwards as
    `DiffusionGemmaForBlockDiffusion.generate` given its processor's inputs, under the same seed
    (the default cache in the default suite, the exact others in the slow set)."""
    reference, model = float64_pair
    eos = tokenizer.eos_token_id
    stops, model.stop_token_ids = model.stop_token_ids, [eos]
    try:
        for seed, text in enumerate(["Question: what is it?", "Describe both."]):
            images = [picture(40, 60, seed=seed), picture(90, 30, seed=seed + 5)]
            ids, theirs = reference_inputs(reference, tokenizer, text, images)
            config = fastdllm.GenerationConfig.for_model(
                model, gen_length=2 * CANVAS, seed=seed, max_denoising_steps=16, cache=cache
            )
            ours = fastdllm.generate(model, [ids], config=config, images=[images])
            torch.manual_seed(seed)
            out = reference.generate(
                **theirs, max_new_tokens=2 * CANVAS, eos_token_id=eos, pad_token_id=eos, max_denoising_steps=16
            )
            answer = out.sequences[0, theirs["input_ids"].shape[1] :].tolist()
            assert ours.sequences[0].tolist()[: len(answer)] == answer, (text, cache)
            if eos not in answer:
                assert ours.nfe == round(len(answer) / float(out.tokens_per_forward[0])), (text, cache)
    finally:
        model.stop_token_ids = stops


@pytest.mark.parametrize("cache", ["dual", "none"])
def test_the_fixed_shape_step_decodes_images_as_the_eager_one(float64_pair, tokenizer, cache, monkeypatch):
    """`cuda_graphs` (its fixed-shape step run eagerly) for rows with and without pictures: the
    same tokens and forwards; a step that computes an image's columns again (no cache) stays
    eager where images attend both ways, the canvas's steps take the fixed shapes."""
    from fastdllm.engine.kv.runner import KVRunner

    from .conftest import run_eagerly

    reference, model = float64_pair
    calls = run_eagerly(monkeypatch)
    img = reference.config.image_token_id
    prompt = tokenizer.encode("Look:") + [img] + tokenizer.encode(" what is it?")
    rows = [prompt, tokenizer.encode("Question: what is 12 + 30? Answer:"), prompt]
    images = [[picture(40, 60, seed=1)], [], [picture(60, 40, seed=2)]]
    config = fastdllm.GenerationConfig.for_model(model, gen_length=2 * CANVAS, max_denoising_steps=12, cache=cache)
    runner = KVRunner(model).record()
    eager = fastdllm.generate(model, rows, config=config, images=images, row_seeds=[0, 1, 2], kv=runner)
    graphed = fastdllm.generate(
        model, rows, config=config.replace(cuda_graphs=True), images=images, row_seeds=[0, 1, 2]
    )
    assert graphed.sequences.tolist() == eager.sequences.tolist()
    assert graphed.nfe_per_row == eager.nfe_per_row
    both_ways = model.args.extra.get("vision_bidirectional")
    # every step of windows of one width at least, but where images attend both ways those that
    # compute columns before a canvas
    alike = [
        w
        for w in runner.history[1:]
        if len({hi - lo for _, lo, hi, _, _ in w}) == 1 and not (both_ways and any(lo < s for _, lo, *_, s in w))
    ]
    assert len(calls) >= len(alike)
    assert calls == [] if both_ways and cache == "none" else len(calls) > 0


def test_rows_with_and_without_images_decode_as_alone(one, tokenizer):
    """Rows of different images, the same image twice and a text row, batched: each row's tokens
    are its tokens alone; an image changes the answer; the prefix store shares a prompt's K/V only
    with the same picture."""
    reference, model, _ = one
    img = reference.config.image_token_id
    a, b = picture(40, 60, seed=1), picture(60, 40, seed=2)
    prompt = tokenizer.encode("Look:") + [img] + tokenizer.encode(" what is it?")
    text = tokenizer.encode("Question: what is 12 + 30? Answer:")
    config = fastdllm.GenerationConfig.for_model(model, gen_length=2 * CANVAS, seed=0, max_denoising_steps=12)
    rows, images = [prompt, prompt, prompt, text], [[a], [b], [a], []]
    together = fastdllm.generate(model, rows, config=config, images=images, row_seeds=[0, 0, 0, 0])
    for i, (ids, imgs) in enumerate(zip(rows, images)):
        alone = fastdllm.generate(model, [ids], config=config, images=[imgs], row_seeds=[0])
        assert torch.equal(together.sequences[i], alone.sequences[0]), i
    streamed = {}  # streaming the blocks of a row with a picture gives its tokens too
    for b, blocks, _ in fastdllm.stream_blocks(model, rows[:1], config, row_seeds=[0], images=images[:1]):
        streamed[b] = blocks[0]
    flat = sum((streamed[b] for b in sorted(streamed)), [])
    assert flat and together.sequences[0].tolist()[: len(flat)] == flat  # (blocks after a stop stream empty)
    assert not torch.equal(together.sequences[0], together.sequences[1])
    assert torch.equal(together.sequences[0], together.sequences[2])
    # through a fresh prefix store: a prompt's picture keys its blocks, so the same picture's prompt
    # reuses the first row's K/V and another picture's computes its own
    from fastdllm.engine.kv import KVRunner

    sharing = config.replace(prefix_cache="approximate")  # how its prompts are shared
    shared = fastdllm.generate(
        model, rows[:3], config=sharing, images=images[:3], row_seeds=[0, 0, 0], kv=KVRunner(model)
    )
    placed = len(model.place_images(prompt, [a])[0])
    assert shared.stats.prompt_positions[:2] == [placed, placed] and shared.stats.prompt_positions[2] < placed
    assert torch.equal(shared.sequences[2], shared.sequences[0])


def test_images_that_do_not_fit_are_refused_by_name(one, tokenizer, tiny_llada):
    reference, model, _ = one
    c = reference.config
    prompt = tokenizer.encode("Look:") + [c.image_token_id]
    with pytest.raises(ValueError, match="images: 2 image"):
        fastdllm.generate(model, [prompt], images=[[picture(40, 60), picture(40, 60)]], gen_length=CANVAS)
    with pytest.raises(ValueError, match="images: an image of"):
        model.place_images([c.boi_token_id, c.image_token_id, c.image_token_id, c.eoi_token_id], [picture(40, 60)])
    with pytest.raises(ValueError, match="images: not an image"):
        model.place_images(prompt, [b"not a picture"])
    context = model.args.max_seq_len
    try:  # a context the pictures do not fit: refused before the tower runs
        model.args = replace(model.args, max_seq_len=len(prompt) + 10)
        with pytest.raises(ValueError, match=r"images: the prompt with its 1 picture\(s\) \(60 soft tokens\)"):
            model.place_images(prompt, [picture(40, 60)])
    finally:
        model.args = replace(model.args, max_seq_len=context)
    with pytest.raises(ValueError, match="images: .* takes no images"):
        fastdllm.generate(tiny_llada, [[5, 6, 7]], images=[[picture(40, 60)]], gen_length=32)


def test_a_data_url_image_answers_as_the_picture_does(one, tokenizer):
    from fastdllm.text.images import open_image

    _, model, _ = one
    image = picture(40, 60, seed=4)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert torch.equal(model.image_features(url), model.image_features(image))
    assert np.array_equal(np.asarray(open_image(url)), np.asarray(image))
    with pytest.raises(ValueError, match="images: URLs are not fetched"):
        open_image("http://example.com/a.png")
    for bad in ("data:image/png;base64,***", "data:text/plain;base64,aGk="):
        with pytest.raises(ValueError, match="image_url: "):
            open_image(bad)


def test_a_checkpoint_without_its_tower_loads_as_text(tmp_path, image_tokenizer):
    """A text-only conversion (vision weights left out, config unchanged) loads; images are refused."""
    from safetensors.torch import load_file, save_file

    make_reference(image_tokenizer, tmp_path, images=True)
    (path,) = tmp_path.glob("*.safetensors")
    save_file({k: v for k, v in load_file(path).items() if "vision" not in k}, path, metadata={"format": "pt"})
    model, _ = fastdllm.load(str(tmp_path), dtype="float32")
    assert not model.takes_images
    with pytest.raises(ValueError, match="images: "):
        model.place_images([model.args.extra["image_token_id"]], [picture(40, 60)])


def test_the_server_answers_a_chat_with_an_image_as_generate_does(one):
    """An `image_url` part (a data URL) in a user message: the answer is `generate`'s with the
    picture; a URL to fetch, a broken image, an image in an assistant message are each a 400
    naming `messages`, and the server answers the next request; requests with pictures, without and
    broken at once each answer as alone."""
    from tests.test_server import MODEL, LiveServer, wait_for

    _, model, folder = one
    tok = fastdllm.load(str(folder), dtype="float32")[1]
    image = picture(40, 60, seed=6)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    config = fastdllm.GenerationConfig.for_model(model, gen_length=2 * CANVAS, max_denoising_steps=8)
    content = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " what?"},
    ]
    ids = tok.encode_chat(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " what?"}],
            }
        ]
    )
    want = fastdllm.generate(model, [ids], config=config.replace(seed=0), images=[[image]])
    server = LiveServer(model, tok, defaults=config)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2 * CANVAS, "seed": 0}
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(
            want.sequences[0][: want.num_tokens[0]].tolist()
        )
        soft = model.image_features(image).shape[0]  # the placeholder became boi, its soft tokens, eoi
        assert r.json()["usage"]["prompt_tokens"] == len(ids) - 1 + 2 + soft
        counted = server.post("/tokenize", {"model": MODEL, "messages": body["messages"]}).json()
        assert counted["tokens"] == model.place_images(ids, [image])[0] and counted["count"] == len(ids) + 1 + soft
        bad = [
            [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        ]
        for part in bad:
            r = server.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": part}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assistant = {"role": "assistant", "content": content}
        r = server.post("/v1/chat/completions", {**body, "messages": [assistant, {"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "messages" in r.json()["error"]["param"], r.text
        # a picture's request, another picture's, a text request and a broken one at once: each
        # answers as alone (they share batches), and the broken one fails alone
        import concurrent.futures

        other = picture(60, 40, seed=7)
        buffer = io.BytesIO()
        other.save(buffer, format="PNG")
        other_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        text = {**body, "messages": [{"role": "user", "content": "what is 2 + 2?"}]}
        swapped = [{**content[1], "image_url": {"url": other_url}} if p is content[1] else p for p in content]
        broken = {**body, "messages": [{"role": "user", "content": bad[1]}]}
        requests = [body, {**body, "messages": [{"role": "user", "content": swapped}]}, text, broken]
        alone = [server.post("/v1/chat/completions", b).json() for b in requests[:3]]
        server.scheduler.pause()  # they queue, and start as one batch
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                sent = [pool.submit(server.post, "/v1/chat/completions", b) for b in requests]
                wait_for(lambda: server.health()["queued"] == 3)  # the broken one was refused at once
                batched = server.health()["batched_requests"]
                server.scheduler.resume()
                together = [f.result() for f in sent]
        finally:
            server.scheduler.resume()
        assert [r.status_code for r in together] == [200, 200, 200, 400]
        assert server.health()["batched_requests"] == batched + 3
        for a, t in zip(alone, together):
            assert t.json()["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert alone[0]["choices"][0]["message"]["content"] != alone[1]["choices"][0]["message"]["content"]
    finally:
        server.stop()


def test_the_cli_and_generate_text_answer_with_an_image_file(one, capsys, tmp_path):
    """`fastdllm generate --image FILE` and `generate_text(messages=...)` with an image part give
    `generate`'s tokens for the prompt the chat template writes; a text-only flag use is refused."""
    from fastdllm.cli.main import main as cli

    _, model, folder = one
    tok = fastdllm.load(str(folder), dtype="float32")[1]
    image, path = picture(50, 40, seed=8), tmp_path / "photo.png"
    image.save(path)
    content = [{"type": "image"}, {"type": "text", "text": "what is it?"}]
    ids = tok.encode_chat([{"role": "user", "content": content}])
    config = fastdllm.GenerationConfig.for_model(model, gen_length=CANVAS, max_denoising_steps=5, seed=0)
    want = fastdllm.generate(model, [ids], config=config, images=[[image]])
    n = int(want.num_tokens[0])
    argv = ["generate", "--model", str(folder), "--max-new-tokens", str(CANVAS), "--max-denoising-steps", "5"]
    assert cli([*argv, "--seed", "0", "--json", "--image", str(path), "what is it?"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == tok.decode(want.sequences[0][:n].tolist())
    assert result["prompt_tokens"] == len(ids) - 1 + 2 + model.image_features(image).shape[0]  # as placed
    messages = [{"role": "user", "content": [{"type": "image", "path": str(path)}, content[1]]}]
    out = fastdllm.generate_text(model, tok, messages=messages, config=config)
    assert out.text == result["text"]
    assert cli([*argv, "--raw", "--image", str(path), "what is it?"]) == 2
    assert "--image" in capsys.readouterr().err


def test_a_saved_checkpoint_keeps_its_tower_and_processor(one, tmp_path):
    """`fastdllm quantize` leaves the tower unquantized and keeps the image processor's settings;
    a plain save loads in transformers and gives the same soft tokens."""
    from fastdllm.models.loading import quantize_checkpoint, save_pretrained

    _, model, folder = one
    image = picture(70, 50, seed=9)
    quantize_checkpoint(str(folder), tmp_path / "int8", 8)
    again, _ = fastdllm.load(str(tmp_path / "int8"), dtype="float32")
    assert again.quantization is not None and again.vision.a.max_soft_tokens == BUDGET
    assert all(
        type(m) in (torch.nn.Linear, ClippedLinear) for m in again.vision.modules() if "Linear" in type(m).__name__
    )
    assert torch.equal(again.image_features(image), model.image_features(image))
    save_pretrained(model, tmp_path / "plain")
    theirs = type(one[0]).from_pretrained(tmp_path / "plain").eval()
    inputs = processed([image])
    with torch.no_grad():
        want = theirs.model.encoder.get_image_features(inputs["pixel_values"], inputs["image_position_ids"])
    assert torch.allclose(model.image_features(image), want.pooler_output, atol=1e-5)


def test_a_following_rank_decodes_the_pictures_rank_0_sent(one, tokenizer, monkeypatch):
    """Under tensor parallelism the other ranks repeat rank 0's commands (`engine.ranks.follow`):
    a request's placed pictures travel in its `add` command and a CLI prompt's pictures in its
    `generate` command, and the follower decodes the answer rank 0 decodes."""
    from fastdllm.engine import ranks

    reference, model, _ = one
    image = picture(40, 60, seed=10)
    ids = tokenizer.encode("Look:") + [reference.config.image_token_id] + tokenizer.encode(" what?")
    config = fastdllm.GenerationConfig.for_model(model, gen_length=CANVAS, max_denoising_steps=4)
    want = fastdllm.generate(model, [ids], config=config, images=[[image]], row_seeds=[0]).sequences[0]
    placed_ids, placed = model.place_images(ids, [image])
    decoders, generated = [], []

    class Recorded(ranks.BlockDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            decoders.append(self)

    def commands():
        yield ("new", config)
        yield ("add", [placed_ids], [0], config, None, ranks.placed_spec([placed]))
        while decoders[0].active:
            yield ("step",)
        yield ("generate", [ids], config.replace(seed=0), [[image]])
        yield ("stop",)

    stream = commands()
    monkeypatch.setattr(ranks, "_receive", lambda: next(stream))
    monkeypatch.setattr(ranks, "BlockDecoder", Recorded)
    monkeypatch.setattr(ranks, "generate", lambda *a, **k: generated.append(fastdllm.generate(*a, **k)))
    ranks.follow(model, tokenizer)
    (row,) = decoders[0].left
    assert torch.equal(row.answer, want)
    assert torch.equal(generated[0].sequences[0], want)


def test_chat_takes_a_picture_for_the_next_message(one, tmp_path, monkeypatch, capsys):
    """`fastdllm chat`'s `/image PATH` attaches a picture to the next message: the answer is
    `generate`'s for that conversation; a later turn (the picture in its history) is answered; a
    missing file is an error line and the chat goes on."""
    import io as _io

    from fastdllm.cli.main import main as cli

    _, model, folder = one
    tok = fastdllm.load(str(folder), dtype="float32")[1]
    image, path = picture(30, 70, seed=12), tmp_path / "p.png"
    image.save(path)
    turns = f"/image {tmp_path / 'missing.png'}\n/image {path}\nwhat is it?\nand now?\n"
    monkeypatch.setattr("sys.stdin", _io.StringIO(turns))
    flags = ["--max-new-tokens", str(CANVAS), "--max-denoising-steps", "5", "--seed", "0", "--no-stats"]
    assert cli(["chat", "--model", str(folder), *flags]) == 0
    out = capsys.readouterr()
    assert "missing.png: no such file" in out.err and "goes with your next message" in out.err
    config = fastdllm.GenerationConfig.for_model(model, gen_length=CANVAS, max_denoising_steps=5, seed=0)
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    want = fastdllm.generate(model, [tok.encode_chat(first)], config=config, images=[[image]])
    assert out.out.startswith(tok.decode(want.sequences[0][: want.num_tokens[0]].tolist()) + "\n")
    assert out.err.count("error") == 1  # the missing file alone: the second turn, picture in its history, answered


@pytest.mark.slow
def test_a_text_models_server_refuses_an_image_by_name(tiny_llada, tokenizer):
    from tests.test_server import MODEL, LiveServer

    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 4}
    server = LiveServer(tiny_llada, tokenizer)
    try:
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and "takes text only" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages"
        r = server.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        server.stop()
