"""How users install the package: the extras the README and the code name exist under the name
pip (any version) finds them by."""

from __future__ import annotations

import json
import re
import subprocess
import venv

import pytest

from .conftest import REPO

tomllib = pytest.importorskip("tomllib")

EXTRA_IN_TEXT = re.compile(r"fastdllm\[([^\]]+)\]")


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _named_in_docs() -> set[str]:
    texts = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "fastdllm").rglob("*.py"))]
    return {name.strip() for t in texts for group in EXTRA_IN_TEXT.findall(t.read_text()) for name in group.split(",")}


def test_extras_are_declared_in_normalized_form_and_every_one_named_exists():
    """Older pips (23.2, what a fresh venv brings) look an extra up by its name as written: one
    declared as `lm_eval` is published as `lm-eval`, and `pip install "fastdllm[lm_eval]"` then
    installs nothing more, with a warning and exit 0."""
    extras = _extras()
    for name in extras:
        assert name == re.sub(r"[-_.]+", "-", name).lower(), name
    named = _named_in_docs()
    assert "lm-eval" in named
    assert named <= set(extras), named - set(extras)


@pytest.mark.slow
def test_the_readmes_lm_eval_install_line_resolves_with_a_fresh_venvs_own_pip(tmp_path):
    """The README's line, with this checkout for the package, in a new venv's own pip: the resolver
    takes lm-eval in (a dry run: nothing is installed) and never says the extra is unknown."""
    line = next(
        m
        for m in re.finditer(r'pip install "(fastdllm\[[^\]]+\])"', (REPO / "README.md").read_text())
        if "lm-eval" in m.group(1)
    )
    target = line.group(1).replace("fastdllm", str(REPO), 1)
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    out = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(tmp_path / "r.json"), target],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "does not provide the extra" not in out.stderr, out.stderr[-2000:]
    names = {item["metadata"]["name"].lower() for item in json.loads((tmp_path / "r.json").read_text())["install"]}
    assert {"fastdllm", "lm-eval"} <= names or {"fastdllm", "lm_eval"} <= names, sorted(names)
