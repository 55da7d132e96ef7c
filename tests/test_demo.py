"""`fastdllm demo`: what a pane shows (no browser, no Gradio needed), the command's guard, and in
the slow set the page itself in a real headless browser (Debian's chromium and chromedriver,
driven by selenium)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import fastdllm
from fastdllm import ConfigError, GenerationConfig
from fastdllm.cli.main import main as cli
from fastdllm.demo.frames import LABELS, MASK_TEXT, frames, page_fields, pane_config, parse_fixed_words

QUESTION = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"


@pytest.fixture(scope="module")
def embedded():
    return fastdllm.load(device="cpu")


def test_fixed_words_in_fast_dllms_format():
    assert parse_fixed_words("0:Once, 5:upon,10: time ") == {0: " Once", 5: " upon", 10: " time"}
    assert parse_fixed_words("") == {}
    for bad in ("5", "x:word", "3:", "1:a, 1:b"):
        with pytest.raises(ConfigError, match="^fixed: "):
            parse_fixed_words(bad)


def test_a_panes_config_is_the_clis_for_the_same_preset(embedded):
    model, _ = embedded
    config = pane_config(model, "baseline", {"block_length": "8", "threshold": "", "gen_length": "64"})
    assert config == GenerationConfig.baseline(block_length=8, gen_length=64).fit_to_model(model)
    assert pane_config(model, "fast-dllm") == GenerationConfig.fast_dllm().fit_to_model(model)
    with pytest.raises(ConfigError, match="^threshold: "):
        pane_config(model, "default", {"threshold": "high"})
    with pytest.raises(ConfigError, match="^preset: "):
        pane_config(model, "no-such-preset")
    names = {o["name"] for o in page_fields()}
    assert {"gen_length", "threshold", "block_length", "temperature", "remasking", "steps"} <= names
    assert not names & {"fixed", "suffix", "compile"}


def test_frames_follow_the_engines_steps_to_the_answer(embedded):
    model, tok = embedded
    messages = [{"role": "user", "content": QUESTION}]
    config = GenerationConfig.preset("default", gen_length=64, block_length=8, fixed={60: " done"})
    shown = list(frames(model, tok, tok.encode_chat(messages), config))
    steps, last = shown[:-1], shown[-1]
    assert last.done and not any(f.done for f in steps) and len(steps) == last.figures["nfe"]
    want = fastdllm.generate_text(model, tok, messages=messages, config=config)
    assert last.text == want.text and last.text.endswith(" done")
    masked = [sum(label == LABELS["mask"] for _, label in f.canvas) for f in steps]
    assert masked == sorted(masked, reverse=True) and masked[0] < 64 - 1 and masked[-1] == 0
    assert all(any(label == LABELS["new"] for _, label in f.canvas) for f in steps)
    fixed = [label for _, label in last.canvas[60:62]]
    assert all(f.canvas[60:62] == last.canvas[60:62] for f in shown) and fixed == [LABELS["fixed"]] * 2
    assert steps[0].canvas[-1] == (MASK_TEXT, LABELS["mask"])
    assert set(last.figures) == {"tokens", "seconds", "tokens_per_second", "nfe", "positions_per_token"}


def test_a_turn_the_page_cannot_answer_names_what_is_wrong():
    """A bad model path (or message) is one ValueError naming it, before anything is decoded: the
    page shows it as one line and keeps the conversation."""
    pytest.importorskip("gradio")
    from fastdllm.demo.app import Models, turn

    model, tok = fastdllm.load(device="cpu")
    models = Models("llada-arith", model, tok)
    for name, message, words in (("/no/such/model", QUESTION, "model: model folder not found"), ("", " ", "message")):
        with pytest.raises(ValueError, match=words):
            next(turn(models, name, message, [[], []], ["default", "default"], "", "", 0.0, {}))


def test_the_demo_refuses_the_network_without_a_login(capsys):
    assert cli(["demo", "--host", "0.0.0.0"]) == 2
    assert "--auth" in capsys.readouterr().err


# ---- the page, in a real browser --------------------------------------------------------------
BROWSER = shutil.which("chromium") and shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (BROWSER and importlib.util.find_spec("selenium") and importlib.util.find_spec("gradio")),
    reason="needs chromium and chromium-driver (apt) and the demo extra and selenium (pip)",
)
# Every canvas update, as the page showed it: recorded in the page by a MutationObserver, so that
# no update between two polls is missed.
RECORDER = """
window.frames_seen = {left: [], right: []};
for (const side of ["left", "right"]) {
  const node = document.getElementById("canvas-" + side);
  new MutationObserver(() => {
    const list = window.frames_seen[side], text = node.innerText;
    if (list[list.length - 1] !== text) list.push(text);
  }).observe(node, {subtree: true, childList: true, characterData: true});
}
"""


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.slow
@needs_browser
def test_the_demo_in_a_browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "fastdllm", "demo", "--port", str(port), "--left", "baseline", "--right", "default"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = None
    try:
        assert "fastdllm demo: http://127.0.0.1" in server.stdout.readline()
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        # The server answers first (however long a loaded machine takes, while it runs), then the
        # page is given the time its own loading takes.
        url = f"http://127.0.0.1:{port}/"
        while not _answers(url):
            assert server.poll() is None, server.stdout.read()
            time.sleep(0.5)
        driver.get(url)
        WebDriverWait(driver, 120).until(lambda d: d.execute_script("return document.readyState") == "complete")
        WebDriverWait(driver, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#message textarea"))
        # blocks of 8, so that even the fastest pane takes several steps
        driver.find_element(By.CSS_SELECTOR, "#options button.label-wrap, #options > button").click()
        # the accordion renders its controls as it opens
        shown = WebDriverWait(driver, 60).until(
            lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, "#opt-block_length textarea") if e.is_displayed()]
        )
        option = shown[0]
        option.send_keys("8")
        driver.execute_script(RECORDER)
        driver.find_element(By.CSS_SELECTOR, "#message textarea").send_keys(QUESTION)
        t0 = time.time()
        driver.find_element(By.ID, "send").click()
        first, answered_early = None, False
        while True:
            seen = driver.execute_script("return window.frames_seen")
            if first is None and (seen["left"] or seen["right"]):
                first = time.time() - t0
            figures = [driver.find_element(By.ID, f"figures-{s}").text for s in ("left", "right")]
            # the fast pane's answer shows while the baseline still decodes
            right_chat = driver.find_element(By.ID, "chat-right").text
            answered_early |= "tokens/s" not in figures[0] and "####" in right_chat
            if all("tokens/s" in f for f in figures):
                break
            assert time.time() - t0 < 120, "the answers did not finish"
            time.sleep(0.05)
        assert answered_early
        seen = driver.execute_script("return window.frames_seen")
        for side in ("left", "right"):
            assert len(seen[side]) >= 3, (side, seen[side])  # the canvas moved before the answer was done
        for f in figures:
            assert "NFE" in f and "positions/token" in f
        # both panes answer as the CLI does with the same settings
        for side, preset in (("left", "baseline"), ("right", "default")):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fastdllm",
                    "generate",
                    "--json",
                    "--preset",
                    preset,
                    "--block-length",
                    "8",
                    QUESTION,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            answer = json.loads(out.stdout)["text"]
            chat = driver.find_element(By.ID, f"chat-{side}").text
            assert chat.strip().endswith(answer.strip()), (side, chat, answer)
        shot = tmp_path / "demo.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 20_000
        print(f"time to the first canvas update: {first:.2f} s")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(30)
