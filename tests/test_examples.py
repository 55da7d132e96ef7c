"""The examples a user is shown (the README, docs/, every command's --help, the demo's Example
button) give the answers they promise: each arith question in them is one of the embedded model's
problems, and the default model answers it right, through the commands exactly as shown."""

from __future__ import annotations

import codecs
import io
import re
import shlex
import sys

import pytest

import fastdllm
from fastdllm.cli import main as cli
from fastdllm.cli.chat import CHAT_EXAMPLES
from fastdllm.cli.generate import GENERATE_EXAMPLES
from fastdllm.cli.main import EXAMPLES
from fastdllm.evaluation.tasks import arith

from .conftest import REPO

QUESTION = re.compile(r"[A-Z][A-Za-z0-9 ,.']*?(?:How many|How much)[^\"?]*\?")
# What a user reads; docs/results.md and the training notes record runs, and quote their prompts.
SHOWN = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
SHOWN = [f for f in SHOWN if f not in ("docs/results.md", "docs/training-notes.md")]
SHOWN += [str(p.relative_to(REPO)) for p in sorted((REPO / "fastdllm" / "cli").glob("*.py"))]
SHOWN += ["fastdllm/demo/app.py"]


def gold(question: str) -> str:
    answers = {p.question: p.answer.split("####")[-1].strip() for p in arith.test_split()}
    assert question in answers, f"{question!r} is not one of the embedded model's problems: show one that is"
    return answers[question]


def final_answer(text: str) -> str | None:
    found = re.findall(r"#### *(-?\d+)", text)
    return found[-1] if found else None


@pytest.fixture(scope="module")
def default_model():
    return fastdllm.load()


def shown_questions() -> list[tuple[str, str]]:
    return sorted({(f, q) for f in SHOWN for q in QUESTION.findall((REPO / f).read_text())})


@pytest.mark.parametrize("where,question", shown_questions())
def test_every_shown_question_is_answered_right(default_model, where, question):
    model, tok = default_model
    answer = fastdllm.generate_text(model, tok, messages=[{"role": "user", "content": question}])
    assert final_answer(answer.text) == gold(question), (where, answer.text)


def _words(line: str) -> list[str]:
    """A shell line's words: bash's $'...' strings decoded, the comment dropped."""
    line = re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(codecs.decode(m[1], "unicode_escape")), line)
    return shlex.split(line, comments=True)


def command_examples() -> list[str]:
    lines = [line.strip() for text in (EXAMPLES, GENERATE_EXAMPLES, CHAT_EXAMPLES) for line in text.splitlines()]
    return [line for line in lines if line.startswith(("fastdllm", "echo", "printf")) and QUESTION.search(line)]


@pytest.mark.parametrize("line", command_examples())
def test_every_command_example_answers_right(monkeypatch, capsys, line):
    feed, _, command = line.rpartition(" | ")
    stdin = ""
    if feed:
        program, text = _words(feed)
        stdin = codecs.decode(text, "unicode_escape") if program == "printf" else text + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    words = _words(command)
    assert words[0] == "fastdllm"
    assert cli.main(words[1:] + ["--no-stats"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"#### *(-?\d+)", out) == [gold(q) for q in QUESTION.findall(line)], out


def test_the_servers_examples_run_as_printed_and_answer_right():
    """`fastdllm serve --help`'s curl and Python lines, pasted into a shell against a live server (its
    port for 8000), answer the questions they ask."""
    import shutil
    import subprocess

    from fastdllm.cli.serve import SERVE_EXAMPLES

    from .test_server import LiveServer

    model, tok = fastdllm.load()
    server = LiveServer(model, tok)
    try:
        text = SERVE_EXAMPLES.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        pasted = [c.strip() for c in re.split(r"\n\s*\n|\n(?=  \S)", text.split("examples:")[1]) if c.strip()]
        runs = [c for c in pasted if c.startswith(("curl", "python -c"))]
        assert len(runs) == 2
        for command in runs:
            if command.startswith("curl") and shutil.which("curl") is None:
                continue
            command = command.replace("python -c", f"{sys.executable} -c", 1)
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            asked = QUESTION.findall(command)
            assert asked and re.findall(r"#### *(-?\d+)", done.stdout) == [gold(q) for q in asked], done.stdout
    finally:
        server.stop()
