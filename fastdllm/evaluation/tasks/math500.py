"""MATH-500 (Lightman et al. 2023's 500-problem subset of MATH, Hendrycks et al. 2021).

Prompt: Minerva-style (Lewkowycz et al. 2022) 4-shot, the setting Fast-dLLM reports ("MATH,
4-shot"): each exemplar is

    Problem:
    <problem>

    Solution:
    <worked solution>
    Final Answer: The final answer is $<answer>$. I hope it is correct.

separated by blank lines; the prompt ends with "Solution:". The four exemplars below were
written for this package (an algebra, a linear-algebra, a word and an arithmetic problem, none
from MATH's test set). For a chat model the whole prompt is the single user message.

Scoring: the answer is the last \\boxed{...} (nested braces), else Minerva's "The final answer is
$X$", else "the answer is X" (`scoring.extract_math_answer`); equivalence with the gold `answer`
by math-verify alone (`scoring.math_verify_equiv`), so the figure is comparable with lm-eval's
and math-verify's. Each check runs in a worker process and is bounded in time: a check that
takes longer than `timeout` (default 5 s) is killed and counts as wrong.
"""

from __future__ import annotations

from .base import Doc, Score, Task, apply_limit, read_jsonl
from .scoring import MathChecker, extract_math_answer, math_backend

EXEMPLARS = [
    {
        "problem": "What is the sum of all real solutions of $x^2 - 7x + 10 = 0$?",
        "solution": "The quadratic factors as $(x - 2)(x - 5) = 0$, so its solutions are $x = 2$ and $x = 5$. "
        "Their sum is $2 + 5 = 7$.",
        "answer": "7",
    },
    {
        "problem": "Let $\\mathbf{M}$ be a $3 \\times 3$ matrix with $\\det \\mathbf{M} = -2$. Find "
        "$\\det (\\mathbf{M}^3)$.",
        "solution": "The determinant is multiplicative, so $\\det (\\mathbf{M}^3) = (\\det \\mathbf{M})^3 = "
        "(-2)^3 = -8$.",
        "answer": "-8",
    },
    {
        "problem": "A rectangle has a perimeter of 30 units, and its length is twice its width. What is its "
        "area, in square units?",
        "solution": "Let the width be $w$, so the length is $2w$. The perimeter is $2(w + 2w) = 6w = 30$, so "
        "$w = 5$ and the length is $10$. The area is $5 \\cdot 10 = 50$ square units.",
        "answer": "50",
    },
    {
        "problem": "Simplify $\\dfrac{\\sqrt{72}}{\\sqrt{2}} + \\dfrac{1}{2}$.",
        "solution": "We have $\\dfrac{\\sqrt{72}}{\\sqrt{2}} = \\sqrt{\\dfrac{72}{2}} = \\sqrt{36} = 6$, so the "
        "expression equals $6 + \\dfrac{1}{2} = \\dfrac{13}{2}$.",
        "answer": "\\frac{13}{2}",
    },
]


def format_example(problem: str, solution: str | None = None, answer: str | None = None) -> str:
    text = f"Problem:\n{problem}\n\nSolution:"
    if solution is None:
        return text
    return f"{text}\n{solution}\nFinal Answer: The final answer is ${answer}$. I hope it is correct."


class _MathScorer:
    def __init__(self, task: Math500Task, timeout: float | None, backend: str | None = None):
        self.task = task
        self.checker = MathChecker(backend=backend, timeout=timeout or 5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.checker.close()

    def score(self, docs, completions):
        out = []
        for doc, text in zip(docs, completions):
            got = extract_math_answer(text)
            if got is None:
                out.append(Score(False, "no_answer", None))
                continue
            ok, reason = self.checker.check(doc.gold, got)
            verdict = "correct" if ok else ("timeout" if reason == "timeout" else "wrong")
            out.append(Score(ok, verdict, got, reason))
        return out


class Math500Task(Task):
    name = "math500"
    default_num_fewshot = 4
    max_num_fewshot = len(EXEMPLARS)
    description = "MATH-500, Minerva-style 4-shot, \\boxed{} answer, math-verify equivalence"

    def load(self, data_dir=None, limit=None):
        rows = read_jsonl("math500_test", data_dir, required=("problem", "answer"))
        docs = [Doc(f"math500/{r.get('unique_id', i)}", i, r, r["answer"]) for i, r in enumerate(rows)]
        return apply_limit(docs, limit)

    def fewshot(self, k, data_dir=None):
        return EXEMPLARS[:k]

    def prompt_text(self, doc, shots):
        parts = [format_example(s["problem"], s["solution"], s["answer"]) for s in shots]
        parts.append(format_example(doc.data["problem"]))
        return "\n\n".join(parts)

    def stop_strings(self, chat):
        return ["Problem:", "I hope it is correct."]

    def scorer(self, workers=2, timeout=None, backend=None):
        return _MathScorer(self, timeout, backend)

    def result_fields(self, results, timeout=None):
        return {"equivalence_backend": math_backend()}

    @staticmethod
    def backend() -> str:
        return math_backend()
