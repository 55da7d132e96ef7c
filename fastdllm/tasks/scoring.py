"""Answer extraction and checking for the evaluation tasks.

- GSM8K-style (gsm8k, arith): `extract_gsm8k_answer`, `normalize_number`.
- MATH: `extract_math_answer` (last \\boxed{}), `normalize_latex`, `sympy_equiv` (our checker,
  no eval of the text), `math_verify_equiv` (math-verify, when installed), and `MathChecker`,
  which runs the checks in a worker process, each bounded in time.
- Code (humaneval, mbpp): `extract_fenced_code`, `cut_at_stops`.
"""

from __future__ import annotations

import re
from typing import Sequence

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


# ==== MATH: equivalence without math-verify (sympy, no eval of the text) ========================
_UNITS = ("square units", "square feet", "square inches", "square meters", "square centimeters", "units",
          "unit", "cm", "centimeters", "meters", "metres", "km", "kilometers", "inches", "inch", "feet", "foot",
          "ft", "yards", "miles", "mph", "degrees", "degree", "cents", "cent", "dollars", "dollar", "hours", "hour",
          "minutes", "minute", "seconds", "second", "days", "day", "pounds", "ounces", "grams", "kg", "liters",
          "people", "ways", "students", "sq")


def _strip_text_commands(s: str) -> str:
    # \text{...}, \mbox{...}, \textbf{...}, \mathrm{...}: keep the content.
    pattern = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
    prev = None
    while prev != s:
        prev, s = s, pattern.sub(r"\1", s)
    return s


def normalize_latex(answer: str) -> str:
    """A canonical string for a MATH answer: no $, spacing commands, \\left/\\right, units,
    degrees, percent or dollar signs; dfrac -> frac; thousands separators dropped; `x = 5`,
    `x \\in S` reduced to the right-hand side; `(C)` to `C`."""
    s = str(answer).strip()
    s = s.replace("\n", " ").strip("$ ").rstrip(".")
    s = re.sub(r"(?<!\\)\\[!,;:]", "", s)  # thin spaces (not the row break \\)
    s = re.sub(r"(?<!\\)\\ ", " ", s)
    for a, b in (("~", " "), ("\\left", ""), ("\\right", ""), ("\\displaystyle", ""), ("\\dfrac", "\\frac"),
                 ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\circ", ""), ("\\degree", ""),
                 ("\\%", ""), ("%", ""), ("\\$", ""), ("\\dots", "..."), ("\\ldots", "..."), ("\\cdots", "..."),
                 ("\\le", "\\leq"), ("\\leqq", "\\leq"), ("\\ge", "\\geq"), ("\\geqq", "\\geq")):
        s = s.replace(a, b)
    s = s.replace("\\leqq", "\\leq").replace("\\geqq", "\\geq")
    s = _strip_text_commands(s)
    s = re.sub(r"\^\{?\\prime\}?", "'", s)
    # Units after a number (also squared units).
    units = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    s = re.sub(rf"(?<=[\d}}\s])\s*(?:{units})(?:\s*\^\s*\{{?[23]\}}?)?\s*$", "", s).strip()
    # `x = 5`, `k = -2`, `x \in [a, b]`: the right-hand side when the left is one variable.
    m = re.match(r"^\s*[a-zA-Z](?:_\{?\w+\}?)?\s*(?:=|\\in)\s*(.+)$", s)
    if m and "=" not in m.group(1):
        s = m.group(1)
    # Multiple choice: (C), \text{(C)}, C)
    m = re.match(r"^\(?([A-E])\)?$", s.strip())
    if m:
        s = m.group(1)
    # Thousands separators in a plain number: 10,080 -> 10080
    if re.fullmatch(r"-?\d{1,3}(,\s?\d{3})+(\.\d+)?", s.strip()):
        s = s.replace(",", "").replace(" ", "")
    s = re.sub(r"\s+", " ", s).strip()
    if re.fullmatch(r"-?\d+\.\d*?0+", s):  # 18.90 -> 18.9, 5.0 -> 5
        s = s.rstrip("0").rstrip(".")
    return s


class _LatexParser:
    """A small recursive-descent LaTeX -> sympy parser for answers: numbers, variables,
    + - * / ^ !, implicit products, \\frac, \\sqrt[n]{}, \\binom, \\pi, \\infty, \\e, functions
    (\\sin ... \\ln \\log \\exp), |x|. It builds sympy objects directly (no eval)."""

    TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\\[a-zA-Z]+|\\[{}|]|[a-zA-Z]|\S)")
    FUNCS = ("sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh",
             "ln", "log", "exp")

    def __init__(self, text: str):
        import sympy

        self.sp = sympy
        self.toks = [t for t in self.TOKEN.findall(text) if t.strip()]
        self.i = 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected=None):
        t = self.peek()
        if t is None or (expected is not None and t != expected):
            raise ValueError(f"expected {expected!r}, got {t!r}")
        self.i += 1
        return t

    def parse(self):
        e = self.expr()
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.peek()!r}")
        return e

    def expr(self):
        e = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            t = self.term()
            e = e + t if op == "+" else e - t
        return e

    def _starts_primary(self, t) -> bool:
        if t is None:
            return False
        return (t[0].isdigit() or t[0] == "." or t.isalpha() or t in ("(", "{", "[", "\\{")
                or (t.startswith("\\") and t[1:] in ("frac", "sqrt", "pi", "infty", "binom", "e") + self.FUNCS))

    def term(self):
        e = self.unary()
        while True:
            t = self.peek()
            if t in ("*", "\\cdot", "\\times"):
                self.take()
                e = e * self.unary()
            elif t in ("/", "\\div"):
                self.take()
                e = e / self.unary()
            elif self._starts_primary(t):
                e = e * self.power()
            else:
                return e

    def unary(self):
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power()

    def power(self):
        base = self.primary()
        while self.peek() == "!":
            self.take()
            base = self.sp.factorial(base)
        if self.peek() == "^":
            self.take()
            exp = self.group()
            return base ** exp
        return base

    def group(self):
        """A braced group, or one character (as TeX reads \\frac12 or x^2)."""
        t = self.peek()
        if t == "{":
            self.take()
            e = self.expr()
            self.take("}")
            return e
        if t is not None and t[0].isdigit() and len(t) > 1 and "." not in t:
            self.toks[self.i] = t[1:]
            return self.sp.Integer(int(t[0]))
        if t == "-":
            self.take()
            return -self.group()
        return self.primary()

    def primary(self):
        sp = self.sp
        t = self.take()
        if t[0].isdigit() or t[0] == ".":
            return sp.Rational(t) if "." in t else sp.Integer(int(t))
        if t in ("(", "[", "{", "\\{"):
            close = {"(": ")", "[": "]", "{": "}", "\\{": "\\}"}[t]
            e = self.expr()
            self.take(close)
            return e
        if t == "|":
            e = self.expr()
            self.take("|")
            return sp.Abs(e)
        if t.isalpha():
            name = t
            if self.peek() == "_":
                self.take()
                sub = self.take()
                if sub == "{":
                    parts = []
                    while self.peek() != "}":
                        parts.append(self.take())
                    self.take("}")
                    sub = "".join(parts)
                name += "_" + sub
            return sp.Symbol(name)
        if t.startswith("\\"):
            cmd = t[1:]
            if cmd == "frac":
                num = self.group()
                den = self.group()
                return num / den
            if cmd == "binom":
                n = self.group()
                k = self.group()
                return sp.binomial(n, k)
            if cmd == "sqrt":
                if self.peek() == "[":
                    self.take()
                    n = self.expr()
                    self.take("]")
                    return sp.root(self.group(), n)
                return sp.sqrt(self.group())
            if cmd == "pi":
                return sp.pi
            if cmd == "infty":
                return sp.oo
            if cmd == "e":
                return sp.E
            if cmd in self.FUNCS:
                power = None
                if self.peek() == "^":
                    self.take()
                    power = self.group()
                arg = self.power()
                f = {"ln": sp.log, "log": sp.log, "exp": sp.exp, "arcsin": sp.asin, "arccos": sp.acos,
                     "arctan": sp.atan}.get(cmd) or getattr(sp, cmd)
                value = f(arg)
                return value**power if power is not None else value
            return sp.Symbol(cmd)  # \alpha, \theta ...
        raise ValueError(f"unexpected {t!r}")


def latex_to_sympy(text: str):
    """Parse a (normalised) LaTeX expression into sympy; raises ValueError when it cannot."""
    text = text.strip()
    m = re.fullmatch(r"(-?)(\d+)\s*\\frac\s*\{(\d+)\}\s*\{(\d+)\}", text)  # mixed number 1\frac{4}{5}
    if m:
        import sympy

        value = sympy.Integer(int(m.group(2))) + sympy.Rational(int(m.group(3)), int(m.group(4)))
        return -value if m.group(1) else value
    try:
        return _LatexParser(text).parse()
    except (ValueError, TypeError, ZeroDivisionError, RecursionError, AttributeError) as e:
        raise ValueError(f"cannot parse {text!r}: {e}") from None


def _split_top(s: str, seps: tuple[str, ...]) -> list[str]:
    """Split at separators outside brackets."""
    parts, depth, cur, i = [], 0, "", 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            cur += s[i : i + 2]
            i += 2
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        hit = next((sep for sep in seps if depth == 0 and s.startswith(sep, i)), None)
        if hit:
            parts.append(cur)
            cur = ""
            i += len(hit)
            continue
        cur += c
        i += 1
    parts.append(cur)
    return [p.strip() for p in parts]


def _structure(s: str):
    """('set'|'tuple'|'interval'|'matrix'|'union'|'eq'|'scalar', payload)."""
    s = s.strip()
    if "\\cup" in s:
        parts = _split_top(s, ("\\cup",))
        if len(parts) > 1:
            return ("union", [_structure(p) for p in parts])
    m = re.fullmatch(r"\\begin\{[pbv]?matrix\}(.*)\\end\{[pbv]?matrix\}", s, re.DOTALL)
    if m:
        rows = [r for r in m.group(1).split("\\\\") if r.strip()]
        return ("matrix", [[_structure(c) for c in r.split("&")] for r in rows])
    if s.startswith("\\{") and s.endswith("\\}"):
        return ("set", _expand_pm([p for p in _split_top(s[2:-2], (",",))]))
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _split_top(s[1:-1], (",",)) != [s[1:-1]]:
        items = _split_top(s[1:-1], (",",))
        if len(items) == 2 and (s[0] != "(" or s[-1] != ")" or "\\infty" in s):
            return ("interval", (s[0], [_structure(p) for p in items], s[-1]))
        return ("tuple", [_structure(p) for p in items])
    items = _split_top(s, (",",))
    if len(items) > 1:
        return ("set", _expand_pm(items))
    if "\\pm" in s:
        return ("set", _expand_pm([s]))
    if "=" in s and s.count("=") == 1 and "\\leq" not in s:
        left, right = s.split("=")
        return ("eq", (left, right))
    return ("scalar", s)


def _expand_pm(items: list[str]) -> list:
    out = []
    for item in items:
        if "\\pm" in item:
            out.append(("scalar", item.replace("\\pm", "+", 1)))
            out.append(("scalar", item.replace("\\pm", "-", 1)))
        elif "\\mp" in item:
            out.append(("scalar", item.replace("\\mp", "-", 1)))
            out.append(("scalar", item.replace("\\mp", "+", 1)))
        else:
            out.append(_structure(item))
    return out


def _scalar_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    if re.fullmatch(r"[A-Za-z][A-Za-z ]*", a) or re.fullmatch(r"[A-Za-z][A-Za-z ]*", b):
        if a.lower() == b.lower():
            return True
        if len(a) > 1 and len(b) > 1 and " " not in a + b and len(a) + len(b) > 4:
            return False  # words: compared as text only
    import sympy

    try:
        x, y = latex_to_sympy(a), latex_to_sympy(b)
    except ValueError:
        return False
    try:
        if x == y:
            return True
        if x.is_number and y.is_number:
            if x.has(sympy.oo, -sympy.oo, sympy.zoo) or y.has(sympy.oo, -sympy.oo, sympy.zoo):
                return bool(x == y)
            xv, yv = complex(sympy.N(x, 30)), complex(sympy.N(y, 30))
            return abs(xv - yv) <= 1e-6 * max(1.0, abs(xv))
        diff = sympy.simplify(x - y)
        return diff == 0
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, RecursionError, OverflowError):
        return False


def _equal(a, b) -> bool:
    ka, pa = a
    kb, pb = b
    if ka == "scalar" and kb == "scalar":
        return _scalar_equal(pa, pb)
    if ka == "eq" and kb == "scalar":  # y = 2x+1 vs 2x+1 was handled by normalisation; compare rhs
        return _scalar_equal(pa[1].strip(), pb)
    if kb == "eq" and ka == "scalar":
        return _scalar_equal(pa, pb[1].strip())
    if ka == "eq" and kb == "eq":
        if _scalar_equal(pa[0].strip(), pb[0].strip()) and _scalar_equal(pa[1].strip(), pb[1].strip()):
            return True
        try:
            import sympy

            ea = latex_to_sympy(pa[0]) - latex_to_sympy(pa[1])
            eb = latex_to_sympy(pb[0]) - latex_to_sympy(pb[1])
            ratio = sympy.simplify(ea / eb)
            return bool(ratio.is_number and ratio != 0)
        except (ValueError, TypeError, ZeroDivisionError, AttributeError):
            return False
    if ka != kb:
        if {ka, kb} == {"tuple", "set"} or {ka, kb} == {"tuple", "interval"}:
            la = pa if ka != "interval" else pa[1]
            lb = pb if kb != "interval" else pb[1]
            if {ka, kb} == {"tuple", "interval"} and (ka == "interval" and pa[0] + pa[2] != "()"
                                                      or kb == "interval" and pb[0] + pb[2] != "()"):
                return False
            return len(la) == len(lb) and all(_equal(x, y) for x, y in zip(la, lb))
        return False
    if ka in ("tuple",):
        return len(pa) == len(pb) and all(_equal(x, y) for x, y in zip(pa, pb))
    if ka == "interval":
        return pa[0] == pb[0] and pa[2] == pb[2] and all(_equal(x, y) for x, y in zip(pa[1], pb[1]))
    if ka == "matrix":
        return len(pa) == len(pb) and all(len(r) == len(s) and all(_equal(x, y) for x, y in zip(r, s))
                                          for r, s in zip(pa, pb))
    if ka in ("set", "union"):
        if len(pa) != len(pb):
            return False
        left = list(pb)
        for x in pa:
            j = next((j for j, y in enumerate(left) if _equal(x, y)), None)
            if j is None:
                return False
            left.pop(j)
        return True
    return False


def sympy_equiv(gold: str, pred: str) -> bool:
    """Are two MATH answers equivalent? String match after `normalize_latex`, then structure
    (tuples, intervals, sets, matrices, unions, ±) and sympy values. Unbounded in time on
    hostile input: call it through `MathChecker`, which runs it in a killable process."""
    if pred is None:
        return False
    g, p = normalize_latex(gold), normalize_latex(pred)
    if g == p:
        return True
    if not g or not p:
        return False
    return _equal(_structure(g), _structure(p))


def math_verify_equiv(gold: str, pred: str) -> bool:
    """math-verify's verdict on two answers (LaTeX extraction only: no eval of the text)."""
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]
    strip = lambda s: str(s).strip().strip("$")  # noqa: E731
    g = parse("$" + strip(gold) + "$", extraction_config=config)
    p = parse("$" + strip(pred) + "$", extraction_config=config)
    if not g or not p:
        return normalize_latex(gold) == normalize_latex(pred)
    return bool(verify(g, p))


def math_backend() -> str:
    """'math_verify' when the package is installed, else 'sympy'."""
    import importlib.util

    return "math_verify" if importlib.util.find_spec("math_verify") is not None else "sympy"


def math_equiv(gold: str, pred: str | None, backend: str | None = None) -> bool:
    """In-process equivalence (no time bound): prefer MathChecker in pipelines."""
    if pred is None:
        return False
    if (backend or math_backend()) == "math_verify":
        return math_verify_equiv(gold, pred) or sympy_equiv(gold, pred)
    return sympy_equiv(gold, pred)


# ==== MATH: time-bounded checks in a worker process ============================================
class MathChecker:
    """Equivalence checks in a separate Python process, each bounded in time: on timeout the
    worker is killed (and restarted for the next check) and the answer counts as wrong.

    The worker reads one JSON request per line on stdin and answers one per line on stdout;
    nothing of the model's text is evaluated as code (math-verify's LaTeX parser, or ours)."""

    def __init__(self, backend: str | None = None, timeout: float = 5.0, memory_mb: int = 4096):
        self.backend = backend or math_backend()
        if self.backend not in ("math_verify", "sympy"):
            raise ValueError(f"backend: must be math_verify or sympy (got {self.backend!r})")
        self.timeout, self.memory_mb = timeout, memory_mb
        self.proc = None
        self.timeouts = 0
        self.start_timeout = 120.0  # importing sympy / math-verify in a fresh worker
        import threading

        self._lock = threading.Lock()

    def _start(self):
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = f"from fastdllm.tasks.scoring import _worker_main; _worker_main({self.memory_mb})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1,
                                     start_new_session=True)
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
                    self.proc.stdin.write(json.dumps({"gold": gold, "pred": pred, "backend": self.backend}) + "\n")
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
    try:  # import up front, so that the time of a check is the check's
        import sympy  # noqa: F401

        import math_verify  # noqa: F401
    except ImportError:
        pass
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["backend"] == "math_verify":
                equal = math_verify_equiv(req["gold"], req["pred"]) or sympy_equiv(req["gold"], req["pred"])
            else:
                equal = sympy_equiv(req["gold"], req["pred"])
            reply = {"equal": bool(equal)}
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
