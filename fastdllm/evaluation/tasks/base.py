"""What every task shares: its data files (`read_jsonl`, `DataError`), its documents and scores,
the `Task` interface and its scorers (in process, or judged in `fastdllm.sandbox` for code).

Data files are gzip-compressed JSON Lines under `fastdllm/evaluation/data/` (see its README.md for sources
and licences); `data_dir` points at other copies with the same file names, `.jsonl.gz` or
`.jsonl`. A missing file or a malformed line is a `DataError` naming the file (and line).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class DataError(ValueError):
    """A missing or malformed data file (the message names it, and the line)."""


class UnknownTaskError(ValueError):
    pass


@dataclass
class Doc:
    """One test item."""

    id: str  # stable id, e.g. "gsm8k/12", "HumanEval/0", "mbpp/11"
    index: int  # position in the task's (full) test list
    data: dict  # the raw row
    gold: str  # the reference answer, as logged


@dataclass
class Score:
    correct: bool
    verdict: str  # QA: correct | wrong | no_answer | timeout; code: the sandbox verdict
    extracted: str | None  # the answer (or program) that was scored
    reason: str = ""
    extra: dict = field(default_factory=dict)


# ---- data --------------------------------------------------------------------------------------
def find_data_file(base: str, data_dir: str | Path | None = None) -> Path:
    folder = Path(data_dir) if data_dir is not None else DATA_DIR
    names = [base + ".jsonl.gz", base + ".jsonl"]
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"{folder / names[0]}: missing data file (also looked for {names[1]})")


def read_jsonl(base: str, data_dir: str | Path | None = None, required: Sequence[str] = ()) -> list[dict]:
    """Rows of `<data_dir>/<base>.jsonl.gz` (or `.jsonl`); every row must be a JSON object with
    the `required` fields."""
    path = find_data_file(base, data_dir)
    rows = []
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                missing = [k for k in required if k not in row]
                if missing:
                    raise DataError(f"{path}:{lineno}: missing field {missing[0]!r}")
                rows.append(row)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot be read ({e})") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def apply_limit(docs: list[Doc], limit: int | None) -> list[Doc]:
    if limit is None:
        return docs
    if limit < 1:
        raise ValueError(f"limit: must be a positive integer (got {limit})")
    return docs[:limit]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# ---- the task interface ------------------------------------------------------------------------
class _NullScorer:
    """Scores answers in process (text tasks); a context manager like every scorer."""

    def __init__(self, task: Task):
        self.task = task

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass

    def score(self, docs: Sequence[Doc], completions: Sequence[str]) -> list[Score]:
        return [self.task.score_one(d, c) for d, c in zip(docs, completions)]


class _CodeScorer(_NullScorer):
    """Judges each answer against its tests in the sandbox (`sandbox.judge`: the tests and the
    solution run in two processes that exchange only data), `workers` at a time."""

    def __init__(self, task: Task, workers: int, timeout: float | None):
        from ...sandbox import SandboxConfig

        super().__init__(task)
        self.workers = max(1, int(workers))
        self.config = SandboxConfig(timeout=timeout or task.default_timeout)

    def score(self, docs, completions):
        from ...sandbox import judge_many

        checks = [self.task.build_check(d, c) for d, c in zip(docs, completions)]
        results = judge_many(checks, self.config, workers=self.workers)
        return [
            Score(
                r.passed,
                r.verdict,
                ch.solution,
                r.reason,
                {"duration": round(r.duration, 3), "cpu_time": r.to_dict()["cpu_time"]},
            )
            for ch, r in zip(checks, results)
        ]


class Task:
    name: str = ""
    default_num_fewshot: int = 0
    max_num_fewshot: int = 0
    is_code: bool = False
    default_timeout: float = 10.0  # seconds per program (code tasks)
    description: str = ""

    # -- data
    def load(self, data_dir=None, limit: int | None = None) -> list[Doc]:
        raise NotImplementedError

    def check_num_fewshot(self, k: int | None) -> int:
        k = self.default_num_fewshot if k is None else k
        if not isinstance(k, int) or not 0 <= k <= self.max_num_fewshot:
            raise ValueError(f"num_fewshot: {self.name} takes 0..{self.max_num_fewshot} shots (got {k})")
        return k

    def fewshot(self, k: int, data_dir=None) -> list[Any]:
        return []

    # -- prompts
    def prompt_text(self, doc: Doc, shots: list) -> str:
        """The prompt as text: the user message for chat models, the whole prompt otherwise."""
        raise NotImplementedError

    def chat_content(self, doc: Doc, shots: list) -> str:
        """The user message when the prompt goes through the chat template."""
        return self.prompt_text(doc, shots)

    def plain_text(self, doc: Doc, shots: list) -> str:
        """The whole prompt when it goes without a chat template."""
        return self.prompt_text(doc, shots)

    def encode(self, tokenizer, doc: Doc, shots: list, chat: bool | None = None) -> list[int]:
        """The prompt's ids: through the chat template (`chat`; default: when the tokenizer has
        one), else as plain text with the tokenizer's own special tokens (its BOS, where it adds
        one), as `tokenizer(text)` gives them in transformers and Fast-dLLM's eval_llada.py."""
        if has_chat_template(tokenizer) if chat is None else chat:
            return tokenizer.encode_chat([{"role": "user", "content": self.chat_content(doc, shots)}])
        return tokenizer.encode(self.plain_text(doc, shots))

    def render(self, tokenizer, doc: Doc, shots: list, chat: bool | None = None) -> str:
        """The prompt exactly as the model sees it (for logs)."""
        if has_chat_template(tokenizer) if chat is None else chat:
            return tokenizer.render_chat([{"role": "user", "content": self.chat_content(doc, shots)}])
        return self.plain_text(doc, shots)

    def stop_strings(self, chat: bool) -> list[str]:
        return []

    # -- scoring
    def score_one(self, doc: Doc, completion: str) -> Score:
        raise NotImplementedError

    def build_check(self, doc: Doc, completion: str):
        """Code tasks: the `sandbox.CodeCheck` (solution, tests, and what joins them) to judge."""
        raise NotImplementedError

    def result_fields(self, results: dict, timeout: float | None = None) -> dict:
        """What the task's scoring adds to `evaluate`'s results: for code, the sandbox's protections,
        pass@1 and the time limit."""
        if not self.is_code:
            return {}
        from ...sandbox import protections

        return {
            "sandbox_protections": list(protections()),
            "pass@1": results["accuracy"],
            "timeout_s": timeout or self.default_timeout,
        }

    def scorer(self, workers: int = 2, timeout: float | None = None):
        if self.is_code:
            return _CodeScorer(self, workers, timeout)
        return _NullScorer(self)


def score_final_number(doc: Doc, completion: str) -> Score:
    """GSM8K-style scoring (gsm8k, arith): the number after '####' (else the last number), normalised,
    against the normalised gold number."""
    from .scoring import extract_gsm8k_answer, normalize_number

    got = extract_gsm8k_answer(completion)
    if got is None:
        return Score(False, "no_answer", None)
    ok = got == normalize_number(doc.gold)
    return Score(ok, "correct" if ok else "wrong", got)
