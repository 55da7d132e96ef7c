"""Answer extraction and checking for the evaluation tasks.

- GSM8K-style (gsm8k, arith): `extract_gsm8k_answer`, `normalize_number`.
- MATH: `extract_math_answer` (last \\boxed{}), `math_verify_equiv` (math-verify, the one
  checker), and `MathChecker`, which runs the checks in a worker process, each bounded in time.
- Code (humaneval, mbpp): `extract_fenced_code`, `cut_at_stops`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5'; '$7' -> '7'; None when there is no number."""
    m = _NUMBER.search(text.replace("$", ""))
    if not m:
        return None
    s = m.group(0).replace(",", "")
    try:
        value = float(s)
    except ValueError:
        return None
    if value == int(value):
        return str(int(value))
    return repr(value)


def extract_gsm8k_answer(completion: str) -> str | None:
    """The number after the first '####' when present, else the last number in the text."""
    if "####" in completion:
        found = normalize_number(completion.split("####", 1)[1])
        if found is not None:
            return found
    numbers = _NUMBER.findall(completion.replace("$", ""))
    return normalize_number(numbers[-1]) if numbers else None


# ==== MATH: answer extraction ====================================================================
def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; also `\\boxed 5`."""
    if not text:
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # \boxed 5 : up to the next space or dollar
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: no answer


_FINAL_ANSWER = re.compile(r"final answer is\s*\$(.+?)\$", re.IGNORECASE | re.DOTALL)
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^$\n]+?)\$?\s*(?:\.\s|\.?$|\n)", re.IGNORECASE)


def extract_math_answer(text: str) -> str | None:
    """The answer of a MATH solution: the last \\boxed{}, else Minerva's "Final Answer: The
    final answer is $X$", else "the answer is X"; None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _FINAL_ANSWER.findall(text)
    if found:
        inner = found[-1].strip()
        return (last_boxed(inner) or inner).strip()
    found = _ANSWER_IS.findall(text)
    if found:
        return found[-1].strip()
    return None


# ==== MATH: equivalence by math-verify alone ===================================================
def math_verify_equiv(gold: str, pred: str) -> bool:
    """math-verify's verdict on two answers, each parsed as the LaTeX math `$answer$` (no eval of
    the text). An answer it cannot parse is wrong: one checker, so that MATH-500 figures compare
    with what lm-eval and math-verify users publish."""
    from math_verify import parse, verify

    strip = lambda s: str(s).strip().strip("$")  # noqa: E731
    g = parse("$" + strip(gold) + "$")
    p = parse("$" + strip(pred) + "$")
    return bool(g and p and verify(g, p))


def math_backend() -> str:
    """The equivalence checker: always math-verify (a hard dependency)."""
    return "math_verify"


def math_equiv(gold: str, pred: str | None) -> bool:
    """In-process equivalence (no time bound): prefer MathChecker in pipelines."""
    return pred is not None and math_verify_equiv(gold, pred)


# ==== MATH: time-bounded checks in a worker process ============================================
class MathChecker:
    """Equivalence checks in a separate Python process, each bounded in time: on timeout the
    worker is killed (and restarted for the next check) and the answer counts as wrong.

    The worker reads one JSON request per line on stdin and answers one per line on stdout;
    nothing of the model's text is evaluated as code (math-verify parses it)."""

    def __init__(self, backend: str | None = None, timeout: float = 5.0, memory_mb: int = 4096):
        self.backend = backend or math_backend()
        if self.backend != "math_verify":
            raise ValueError(f"backend: the only MATH checker is math_verify (got {self.backend!r})")
        self.timeout, self.memory_mb = timeout, memory_mb
        self.proc = None
        self.timeouts = 0
        self.start_timeout = 120.0  # importing math-verify (and sympy) in a fresh worker
        import threading

        self._lock = threading.Lock()

    def _start(self):
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[3])  # the folder holding the fastdllm package
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = f"from fastdllm.evaluation.tasks.scoring import _worker_main; _worker_main({self.memory_mb})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.start_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith('{"ready"'):
            self._stop()
            raise RuntimeError("the MATH equivalence worker did not start")

    def _stop(self):
        if self.proc is not None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None

    def close(self):
        with self._lock:
            self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._stop()
        except Exception:
            pass

    def check(self, gold: str, pred: str | None) -> tuple[bool, str]:
        """(equivalent, reason): reason is '' or 'timeout' or an error message."""
        import json
        import select

        if pred is None:
            return False, "no answer"
        with self._lock:
            for attempt in (0, 1):
                if self.proc is None or self.proc.poll() is not None:
                    self._stop()
                    self._start()
                try:
                    self.proc.stdin.write(json.dumps({"gold": gold, "pred": pred}) + "\n")
                    self.proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    self._stop()
                    continue
                ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
                if not ready:
                    self.timeouts += 1
                    self._stop()
                    return False, "timeout"
                line = self.proc.stdout.readline()
                if not line:
                    self._stop()
                    if attempt == 0:
                        continue
                    return False, "checker crashed"
                reply = json.loads(line)
                return bool(reply["equal"]), reply.get("error") or ""
            return False, "checker crashed"


def _worker_main(memory_mb: int = 4096) -> None:
    import json
    import resource
    import sys

    try:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
        pass
    import math_verify  # noqa: F401 - import up front, so that the time of a check is the check's

    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"equal": math_verify_equiv(req["gold"], req["pred"])}
        except Exception as e:  # a parser error is a wrong answer, not a crash
            reply = {"equal": False, "error": f"{type(e).__name__}: {e}"[:200]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


# ==== code: post-processing of model output =====================================================
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_fenced_code(text: str, must_contain: str | None = None) -> str | None:
    """The code of a markdown fence (```python ... ```, an unterminated one too): the first
    block containing `must_contain` when given, else the first python (or untagged) block."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if not blocks:
        return None
    if must_contain:
        for _, body in blocks:
            if must_contain in body:
                return body
    for lang, body in blocks:
        if lang in ("", "python", "py", "python3"):
            return body
    return blocks[0][1]


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """Text up to the earliest stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]
