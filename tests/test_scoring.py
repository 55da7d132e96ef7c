"""The scoring pipelines score the gold data correctly, and reject wrong answers."""

from __future__ import annotations

import time

import pytest

from fastdllm.evaluation.tasks import get_task
from fastdllm.evaluation.tasks.humaneval import extract_program
from fastdllm.evaluation.tasks.mbpp import extract_code
from fastdllm.evaluation.tasks.scoring import (
    MathChecker,
    cut_at_stops,
    extract_fenced_code,
    extract_gsm8k_answer,
    extract_math_answer,
    last_boxed,
    math_verify_equiv,
    normalize_number,
)


# ---- GSM8K / arith ---------------------------------------------------------------------------
def test_gsm8k_gold_solutions_all_correct():
    task = get_task("gsm8k")
    docs = task.load()
    assert len(docs) == 1319
    scores = [task.score_one(d, d.data["answer"]) for d in docs]
    assert all(s.correct for s in scores)
    assert not task.score_one(docs[0], "The answer is 17.").correct  # gold is 18
    assert task.score_one(docs[0], "so she makes $18 a day").correct
    assert task.score_one(docs[0], "nothing").verdict == "no_answer"


def test_arith_gold_solutions_all_correct():
    task = get_task("arith")
    docs = task.load()
    assert len(docs) == 1000
    assert all(task.score_one(d, d.data["answer"]).correct for d in docs)


def test_gsm8k_extraction():
    assert extract_gsm8k_answer("3 + 4 = 7\n#### 1,234") == "1234"
    assert extract_gsm8k_answer("it costs $5.50 then $7.00") == "7"
    assert extract_gsm8k_answer("#### -3") == "-3"
    assert normalize_number("2.50") == "2.5"


# ---- MATH ------------------------------------------------------------------------------------
def test_boxed_extraction():
    assert (
        last_boxed("so \\boxed{\\frac{1}{2}} and finally \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.")
        == "\\left( 3, \\frac{\\pi}{2} \\right)"
    )
    assert last_boxed("\\boxed{a{b{c}}d}") == "a{b{c}}d"
    assert last_boxed("\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{unbalanced") is None
    assert (
        extract_math_answer("Final Answer: The final answer is $\\frac{13}{2}$. I hope it is correct.")
        == "\\frac{13}{2}"
    )
    assert extract_math_answer("no answer here") is None


EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\frac12", "\\dfrac{1}{2}"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("x=5", "5"),
    ("\\text{(C)}", "C"),
    ("10\\%", "10"),
    ("90^\\circ", "90"),
    ("\\$18.90", "18.9"),
    ("1\\frac{4}{5}", "\\frac95"),
    ("\\{1\\pm\\sqrt{5},-2\\}", "-2, 1+\\sqrt5, 1-\\sqrt5"),
    ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
    ("\\text{Evelyn}", "Evelyn"),
    ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "\\begin{pmatrix} 0.2 \\\\ -3.6 \\end{pmatrix}"),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)"),
    ("x^5 - x^4 + x^3 - x^2 + x - 1", "x^5+x^3+x-x^4-x^2-1"),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
    ("3 \\pm 2 \\sqrt{2}", "3+2\\sqrt2, 3-2\\sqrt2"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)"),
    ("5x - 7y + 11z + 4 = 0", "-5x + 7y - 11z - 4 = 0"),
    ("\\frac{11+9a}{20}", "\\frac{9a+11}{20}"),
    ("137 \\frac{1}{2}", "137.5"),
    ("10,\\!080", "10080"),
    ("x \\in [-2,7]", "[-2,7]"),
    ("\\frac{20000}{\\pi}", "20000/\\pi"),
    ("\\dfrac{33}{100}", "0.33"),
    ("6\\sqrt{2}", "\\sqrt{72}"),
]
NOT_EQUIVALENT = [
    ("(1,2]", "(1,2)"),
    ("\\pi", "3.14"),
    ("\\text{Evelyn}", "Navin"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi)"),
    ("8n^2 + 4n + 1", "8n^2+4n+2"),
    ("\\sqrt{51}", "\\sqrt{52}"),
    ("2", "3"),
    ("\\text{even}", "odd"),
    ("[-2,7]", "(-2,7)"),
    ("\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", "\\begin{pmatrix} -1 & 0 \\\\ 0 & 1 \\end{pmatrix}"),
    ("\\frac{1}{3}", "0.33"),
    ("-2", "2"),
    ("\\{1, 2\\}", "\\{1, 2, 3\\}"),
    ("(1,2)", "(2,1)"),
]


# A second, lenient checker once accepted these; math-verify (the one checker) does not.
LENIENT = [("\\pi", "3.14159"), ("3", "3.0000001"), ("1", "0.9999999")]


@pytest.mark.parametrize("gold,pred", EQUIVALENT)
def test_equivalent_pairs(gold, pred):
    assert math_verify_equiv(gold, pred) and math_verify_equiv(pred, gold)


@pytest.mark.parametrize("gold,pred", NOT_EQUIVALENT + LENIENT)
def test_non_equivalent_pairs(gold, pred):
    assert not math_verify_equiv(gold, pred)


@pytest.mark.slow
def test_math500_gold_all_correct_and_pairs():
    task = get_task("math500")
    docs = task.load()
    assert len(docs) == 500
    with task.scorer(timeout=10.0) as scorer:
        scores = scorer.score(docs, [d.data["solution"] for d in docs])
        bad = [(d.gold, s.extracted, s.reason) for d, s in zip(docs, scores) if not s.correct]
        assert bad == []
        checker = scorer.checker
        for gold, pred in EQUIVALENT:
            assert checker.check(gold, pred)[0], (gold, pred)
        for gold, pred in NOT_EQUIVALENT + LENIENT:
            assert not checker.check(gold, pred)[0], (gold, pred)
        assert scorer.score(docs[:1], ["I cannot solve it."])[0].verdict == "no_answer"


def test_math_check_is_bounded_in_time():
    with MathChecker(timeout=1.0) as checker:
        assert checker.check("2", "2") == (True, "")  # warm: the worker is up
        t0 = time.perf_counter()
        ok, reason = checker.check("2", "(10^{9})!")  # exact factorial of 10^9: never finishes
        assert not ok and reason == "timeout"
        assert time.perf_counter() - t0 < 5
        assert checker.check("\\frac{1}{2}", "0.5") == (True, "")  # a fresh worker takes over
        assert checker.timeouts == 1
    with pytest.raises(ValueError, match="backend"):
        MathChecker(backend="sympy")


# ---- code ------------------------------------------------------------------------------------
HE_PROMPT = 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum."""\n'


def test_humaneval_post_processing():
    body = "    return sum(xs)\n"
    # a plain continuation, cut at the Codex stop sequences
    assert extract_program(HE_PROMPT, "add", body + "\n\ndef other():\n    pass\n") == HE_PROMPT + body + "\n"
    assert extract_program(HE_PROMPT, "add", body + "\n# tests\nprint(add([1]))") == HE_PROMPT + body
    assert extract_program(HE_PROMPT, "add", body + "\nif __name__ == '__main__':\n    pass") == HE_PROMPT + body
    # a chat answer: fenced full function, with the prompt's imports restored
    fenced = "Here you go:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```\nDone."
    program = extract_program(HE_PROMPT, "add", fenced)
    assert program.startswith("from typing import List\n") and "def add" in program and "Done" not in program
    # the prompt echoed
    echoed = HE_PROMPT + body + "\ndef more(): pass"
    assert extract_program(HE_PROMPT, "add", echoed) == HE_PROMPT.rstrip("\n") + "\n" + body
    assert cut_at_stops("abc[DONE]def", ["[DONE]"]) == "abc"
    assert extract_fenced_code("```py\nx = 1\n") == "x = 1\n"  # unterminated fence


def test_mbpp_post_processing():
    assert extract_code("def f():\n    return 1\n[DONE]\nYou are an expert") == "def f():\n    return 1"
    assert extract_code("[BEGIN]\ndef f(): return 1\n[DONE]") == "def f(): return 1"
    assert extract_code("```python\ndef f(): return 1\n```\n[DONE]") == "def f(): return 1"


@pytest.mark.slow
def test_humaneval_canonical_solutions_all_pass():
    task = get_task("humaneval")
    docs = task.load()
    assert len(docs) == 164
    with task.scorer(workers=2) as scorer:
        scores = scorer.score(docs, [d.data["canonical_solution"] for d in docs])
        failed = [(d.id, s.verdict, s.reason) for d, s in zip(docs, scores) if not s.correct]
        assert failed == []
        # wrong solutions fail: returning a constant, a syntax error, an early exit
        wrong = scorer.score(docs[:3], ["    return None\n", "    return (\n", "    import os\n    os._exit(0)\n"])
        assert [s.verdict for s in wrong] == ["failed", "failed", "failed"]


def test_mbpp_reference_code_passes_and_wrong_code_fails():
    """All 500 reference solutions pass in tests/test_judge.py (on a loaded machine, slow); here a
    sample of them, and wrong code fails."""
    task = get_task("mbpp")
    docs = task.load()
    assert len(docs) == 500 and docs[0].id == "mbpp/11" and docs[-1].id == "mbpp/510"
    sample = docs[::50]
    with task.scorer(workers=2) as scorer:
        scores = scorer.score(sample, [d.data["code"] for d in sample])
        failed = [(d.id, s.verdict, s.reason) for d, s in zip(sample, scores) if not s.correct]
        assert failed == []
        wrong = scorer.score(docs[:2], ["def nothing():\n    return 0\n", docs[0].data["code"]])
        assert [s.verdict for s in wrong] == ["failed", "failed"]  # 12's tests on 11's code
