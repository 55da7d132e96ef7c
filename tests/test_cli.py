"""`fastdllm generate` / `fastdllm chat`: end to end in subprocesses on the embedded model, the live
view through a pseudo-terminal and rich's recording console, and one-line errors for mistakes."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
import torch
from rich.console import Console

import fastdllm
from fastdllm.cli import main as cli
from fastdllm.cli.live_view import MASK_GLYPH, STYLE_NEW, LiveView, render_canvas
from fastdllm.cli.session import ChatSession
from fastdllm.config import GenerationConfig
from fastdllm.engine.generation import generate

from .conftest import REPO

QUESTION = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"
SMALL = ["--gen-length", "32", "--block-length", "32"]
STATS = re.compile(r"\[\d+ tokens · \d+ NFE · [\d.]+ tokens/step · [\d.]+ tokens/s · [\d.]+ s\]")
# One thread per subprocess: the machine is shared, and oversubscribed OpenMP threads crawl.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "COLUMNS": "120"}


def run(args, stdin=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "fastdllm", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def loaded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield fastdllm.load()
    torch.set_num_threads(threads)


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_end_to_end():
    plain = run(["generate", *SMALL, "--show", QUESTION])  # --show with stdout piped: plain output
    assert plain.returncode == 0, plain.stderr
    assert "\x1b[" not in plain.stdout and MASK_GLYPH not in plain.stdout
    assert STATS.search(plain.stderr), plain.stderr
    assert "Traceback" not in plain.stderr
    js = run(["generate", *SMALL, "--json", "-"], stdin=QUESTION + "\n")  # prompt from stdin
    assert js.returncode == 0, js.stderr
    record = json.loads(js.stdout)
    assert {"text", "tokens", "nfe", "tokens_per_step", "tokens_per_second", "config"} <= set(record)
    assert record["text"] + "\n" == plain.stdout
    assert record["config"]["gen_length"] == 32 and record["config"]["threshold"] == 0.9
    assert record["chat_template"] is True and 0 <= record["tokens"] <= 32 and record["nfe"] >= 1
    assert record["tokens_per_step"] == round(record["tokens"] / record["nfe"], 4)  # the answer's, not the padding


@pytest.mark.slow
def test_chat_end_to_end():
    script = (
        f"{QUESTION}\n/reset\n\n/nonsense\nAnn has 12 pencils. She gives 4 away. How many are left?\n"
        "/exit\nnever read\n"
    )
    r = run(["chat", *SMALL], stdin=script)
    assert r.returncode == 0, r.stderr
    assert len(STATS.findall(r.stderr)) == 2  # two answers, the line after /exit is not read
    assert "(conversation reset)" in r.stderr and "unknown command /nonsense" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_flag_value_is_one_line_exit_2():
    r = run(["generate", "--threshold", "2", QUESTION])
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("fastdllm generate: error: --threshold") and "Traceback" not in r.stderr
    assert r.stdout == ""


def in_a_terminal(argv: list[str], answer=None, timeout: float = 180) -> tuple[int, bytes]:
    """`python -m fastdllm ARGV` on a pseudo-terminal: its exit status and everything it drew;
    `answer(out)` may return bytes to type once the output so far calls for them."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastdllm", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**ENV, "TERM": "xterm-256color"},
        cwd=REPO,
        close_fds=True,
    )
    os.close(slave)
    out, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            out += data
            typed = answer(out) if answer else None
            if typed:
                os.write(master, typed)
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(10), out


@pytest.mark.slow
def test_leaving_chat_with_ctrl_d_ends_the_prompt_line():
    """Ctrl-D at chat's ">>> " prompt ends that line, so the shell's prompt does not start on it."""
    typed = []

    def ctrl_d(out):
        if not typed and out.endswith(b">>> "):
            typed.append(True)
            return b"\x04"
        return None

    rc, out = in_a_terminal(["chat", *SMALL], ctrl_d, timeout=120)
    assert typed and rc == 0, out[-2000:]
    assert out.rstrip(b"\r\n").endswith(b">>> ") and out.endswith(b"\n"), out[-200:]


@pytest.mark.slow
def test_show_draws_live_in_a_terminal():
    rc, out = in_a_terminal(["generate", *SMALL, "--show", QUESTION])
    assert rc == 0, out[-2000:]
    text = out.decode("utf-8", "replace")
    assert MASK_GLYPH in text  # masked positions drawn
    assert "\x1b[" in text  # styled (highlight, underline) and redrawn in place
    assert re.search(r"block 1/1 · step 1 · \d+/32 revealed", text)
    assert STATS.search(text) and "Traceback" not in text


# ---- in-process: errors and help ------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--threshold", "abc", "x"], "--threshold"),
        (["generate", "--gen-length", "30", "--block-length", "32", "x"], "--block-length"),
        (["generate", "--threads", "0", "x"], "--threads"),
        (["generate", "--model", "no/such-q8_0.gguf", "x"], "no GGUF file no/such-q8_0.gguf"),
        (["generate", "--cache", "bogus", "x"], "--cache"),
        (["generate", "--model", "/no/such/folder", "x"], "/no/such/folder"),
        (["generate", "--bogus-flag", "x"], "--bogus-flag"),
        (["generate", "--device", "bogus", "x"], "device"),
        (["generate", "--device", "cuda:99" if torch.cuda.is_available() else "cuda", "x"], "device"),
        (["eval", "--task", "arith", "--device", "mps:7", "--limit", "1"], "device"),
        (["generate", "--dtype", "float13", "x"], "dtype"),
        (["generate", "   "], "empty"),
        (["generate", "--show-delay", "-1", "x"], "--show-delay"),
        (["generate"], "prompt"),
        (["chat", "--temperature", "-1"], "--temperature"),
        (["chat", "--model", "/no/such/folder"], "/no/such/folder"),
        (["serve", "--max-batch-size", "0"], "--max-batch-size"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--threshold", "1.5"], "--threshold"),
    ],
)
def test_user_mistakes_are_one_line(capsys, argv, needle):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fastdllm {argv[0]}: error:"), err
    assert needle in err


def test_text_that_is_not_utf8_is_refused_by_name(capsys, monkeypatch, loaded):
    """Bytes that are not UTF-8 (Python's lone surrogates) in an argument, on stdin or in a chat line
    are a one-line error naming the byte, never a traceback; the chat goes on after it."""
    assert cli.main(["generate", "caf\udce9 au lait"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the byte 0xe9 at character 3" in err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), errors="surrogateescape"))
    assert cli.main(["generate", "-"]) == 2
    assert "the byte 0xe9" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), errors="strict"))
    assert cli.main(["generate", "-"]) == 2
    assert "the byte 0xe9" in capsys.readouterr().err
    _, tok = loaded
    with pytest.raises(ValueError, match="not valid UTF-8 text"):
        tok.encode_chat([{"role": "user", "content": "caf\udce9"}])
    lines = b"caf\xe9\n" + QUESTION.encode() + b"\n/exit\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines), errors="surrogateescape"))
    assert cli.main(["chat", *SMALL, "--no-stats"]) == 0
    out, err = capsys.readouterr()
    assert "the byte 0xe9" in err and "####" in out


def test_a_small_model_decodes_on_one_thread_unless_told(capsys):
    """The embedded models' steps are too small to share between threads (two collapse to a third of
    one's speed beside another job): without --threads the CLI uses one for them; --threads wins."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cli.main(["generate", *SMALL, "--no-stats", QUESTION]) == 0
        assert torch.get_num_threads() == 1
        assert cli.main(["generate", *SMALL, "--threads", "2", "--no-stats", QUESTION]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_a_gen_length_off_the_block_decodes_as_max_new_tokens(capsys):
    """`--gen-length 8` (or 100) against the default blocks decodes whole blocks and keeps that many
    tokens, as the server's max_tokens does, and says so; with --block-length given it stays an error."""
    for n in (8, 100):
        assert cli.main(["generate", "--gen-length", str(n), "--json", QUESTION]) == 0, n
        out, err = capsys.readouterr()
        assert json.loads(out)["tokens"] <= n and f"--max-new-tokens {n}" in err


def test_prompt_beyond_context_is_a_user_error(capsys):
    assert cli.main(["generate", "--gen-length", "2048", "x"]) == 2
    assert "context" in capsys.readouterr().err


def test_a_finetunes_preset_on_another_model_is_warned_of(capsys):
    assert cli.main(["generate", "--preset", "dmax", "--gen-length", "32", "--no-stats", QUESTION]) == 0
    assert "warning: --preset dmax" in capsys.readouterr().err
    assert cli.main(["generate", "--preset", "fast-dllm", "--gen-length", "32", "--no-stats", QUESTION]) == 0
    assert "warning" not in capsys.readouterr().err


def test_help_says_each_default_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: gen_length)" in help_text and not re.search(r"\(default: [^)]*\) \(default:", help_text)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_has_examples(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--threshold" in out and f"fastdllm {command}" in out


# ---- in-process: chat history ------------------------------------------------------------------------
def test_chat_session_keeps_and_resets_history(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, GenerationConfig(gen_length=32, block_length=32), system="Be brief.")
    first = session.send(QUESTION)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[2]["content"] == first.completion.text
    second = session.send("And then?")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert second.prompt_tokens == len(tok.encode_chat(session.messages[:4])) > first.prompt_tokens
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]


def test_chat_session_drops_old_turns_to_fit(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, GenerationConfig(gen_length=32, block_length=32))
    saved = model.args.max_seq_len
    try:
        one_turn = len(tok.encode_chat([{"role": "user", "content": QUESTION}]))
        model.args.max_seq_len = one_turn * 2 + 32 + 8  # room for about one turn of history
        for _ in range(4):
            session.send(QUESTION)
        assert session.dropped_turns >= 2
        assert session.messages[-2]["content"] == QUESTION and len(session.messages) <= 4
    finally:
        model.args.max_seq_len = saved


def test_ctrl_c_stops_the_answer_and_keeps_the_chat(loaded, monkeypatch, capsys):
    """Ctrl-C during an answer forgets that turn and reads the next message."""
    from fastdllm.cli import chat
    from fastdllm.cli import session as sessions

    model, tok = loaded
    session = ChatSession(model, tok, GenerationConfig(gen_length=32, block_length=32))
    decode, interrupted = sessions.run_prompt, []

    def run_prompt(*args, **kw):  # Ctrl-C in the middle of the first answer
        if not interrupted:
            interrupted.append(session.messages[-1]["content"])
            raise KeyboardInterrupt
        return decode(*args, **kw)

    monkeypatch.setattr(sessions, "run_prompt", run_prompt)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question\n" + QUESTION + "\n"))
    assert chat.converse(session, cli_args(show=False, show_delay=0.0, no_stats=True)) == 0
    out, err = capsys.readouterr()
    assert interrupted == ["first question"] and "(answer stopped)" in err
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.messages[0]["content"] == QUESTION and out.strip() == session.messages[1]["content"].strip()


def test_the_live_views_pauses_are_left_out_of_the_speed(loaded):
    """--show pauses after each drawn step by default (a fast model's canvas stays visible); the
    stats line's time is the decode's alone."""
    from fastdllm.cli.session import run_prompt

    model, tok = loaded
    console = Console(file=io.StringIO(), force_terminal=True)
    ids = tok.encode_chat([{"role": "user", "content": QUESTION}])
    answer = run_prompt(model, tok, ids, GenerationConfig(gen_length=32, block_length=32), show=True, console=console)
    assert MASK_GLYPH in console.file.getvalue()
    assert answer.paused >= 0.1 * answer.output.nfe  # a frame a step, each followed by the default pause
    assert answer.wall_time == pytest.approx(answer.output.wall_time - answer.paused)
    assert f"{answer.wall_time:.2f} s]" in answer.stats_line()


def cli_args(**values):
    import argparse

    return argparse.Namespace(**values)


# ---- in-process: the live view ------------------------------------------------------------------------
def _events(loaded, config):
    """Every StepEvent of one generation, rendered right away (the canvas is a live view)."""
    model, tok = loaded
    frames = []
    ids = tok.encode_chat([{"role": "user", "content": QUESTION}])

    def on_step(event):
        frames.append(
            (
                event.kind,
                event.block,
                render_canvas(event, tok, model.mask_token_id, config.block_length, model.stop_token_ids, step=1),
            )
        )

    out = generate(model, [ids], config, on_step=on_step)
    return frames, out


def test_render_canvas_marks_masks_new_tokens_and_current_block(loaded):
    config = GenerationConfig(gen_length=64, block_length=32, threshold=None, stop_at_eos=False)
    frames, out = _events(loaded, config)
    kind, block, first = frames[0]
    assert kind == "step" and block == 0
    body = first.plain.split("\n", 1)[1]
    assert body.count(MASK_GLYPH) == 63  # one token revealed by the first step
    assert body.startswith("[") and body.count("[") == 1 and "]" in body  # the current block bracketed
    new = [s for s in first.spans if STYLE_NEW in str(s.style)]
    assert len(new) == 1 and "underline" in str(new[0].style)  # in the current block
    header = first.plain.split("\n", 1)[0]
    assert header.startswith("block 1/2 · step 1 · 1/64 revealed · +1 this step")

    second_block = next(t for k, b, t in frames if k == "step" and b == 1)
    body = second_block.plain.split("\n", 1)[1]
    assert body.count(MASK_GLYPH) == 31 and body.index("[") > 0  # first block done, second current

    kind, _, last = frames[-1]
    assert kind == "block" and MASK_GLYPH not in last.plain

    console = Console(record=True, width=100, force_terminal=True, color_system="truecolor", file=io.StringIO())
    console.print(first)
    assert MASK_GLYPH in console.export_text(clear=False)
    html = console.export_html()
    assert "text-decoration: underline" in html  # the current block


def test_live_view_draws_only_on_a_terminal(loaded):
    model, tok = loaded
    ids = tok.encode_chat([{"role": "user", "content": QUESTION}])
    config = GenerationConfig(gen_length=32, block_length=32)
    term = Console(record=True, width=100, force_terminal=True, file=io.StringIO())
    view = LiveView(tok, model.mask_token_id, 32, model.stop_token_ids, console=term, min_interval=0, transient=False)
    with view:
        out = generate(model, [ids], config, on_step=view.on_step)
    assert view.enabled and view.frames == view.steps + 1 == out.nfe + 1  # every step, and the block end
    assert "block 1/1" in term.export_text()

    piped = Console(file=io.StringIO(), force_terminal=False)
    view = LiveView(tok, model.mask_token_id, 32, model.stop_token_ids, console=piped)
    with view:
        generate(model, [ids], config, on_step=view.on_step)
    assert not view.enabled and view.frames == 0 and piped.file.getvalue() == ""
