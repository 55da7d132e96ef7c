"""The evaluation tasks: a registry of name -> Task (`get_task`).

A Task knows its data (`load`), its prompts (`encode`, with the model's chat template when the
tokenizer has one, plain text otherwise), the stop strings that end an answer, and how to score
answers (`scorer()`: a context manager whose `score(docs, completions)` returns one `Score` per
answer; code tasks run programs in `fastdllm.sandbox`, MATH checks run in a killable worker).
What they share is in `base`; each task is one module; a new task is one class and one line of
`TASKS`.
"""

from __future__ import annotations

from importlib import import_module

from .base import (
    DATA_DIR,
    DataError,
    Doc,
    Score,
    Task,
    UnknownTaskError,
    apply_limit,
    find_data_file,
    has_chat_template,
    read_jsonl,
    score_final_number,
)

# name -> (module of this package, class); imported on first use
TASKS = {
    "arith": ("arith", "ArithTask"),
    "gsm8k": ("gsm8k", "GSM8KTask"),
    "humaneval": ("humaneval", "HumanEvalTask"),
    "math500": ("math500", "Math500Task"),
    "mbpp": ("mbpp", "MBPPTask"),
    "everyday": ("everyday", "EverydayTask"),
    "everyday-probe": ("everyday", "EverydayProbeTask"),
}
_LOADED: dict[str, Task] = {}

__all__ = [
    "DATA_DIR",
    "DataError",
    "Doc",
    "Score",
    "TASKS",
    "Task",
    "UnknownTaskError",
    "apply_limit",
    "find_data_file",
    "get_task",
    "has_chat_template",
    "list_tasks",
    "read_jsonl",
    "score_final_number",
]


def get_task(name: str | Task) -> Task:
    if isinstance(name, Task):
        return name
    key = str(name).lower()
    if key not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    if key not in _LOADED:
        module, cls = TASKS[key]
        _LOADED[key] = getattr(import_module(f".{module}", __name__), cls)()
    return _LOADED[key]


def list_tasks() -> list[str]:
    return list(TASKS)
