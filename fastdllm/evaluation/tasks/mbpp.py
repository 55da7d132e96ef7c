"""MBPP (Austin et al. 2021): short Python programming problems, scored by pass@1.

Test split: task ids 11-510 (500 problems); few-shot exemplars: task ids 2, 3, 4 (3-shot, the
setting Fast-dLLM reports). The prompt is the benchmark's usual one, each exemplar as

    You are an expert Python programmer, and here is your task: <text> Your code should pass these tests:

    <test 1>
    <test 2>
    <test 3>
    [BEGIN]
    <code>
    [DONE]

separated by blank lines, and the problem last, ending with "[BEGIN]\\n": the model writes the
code and "[DONE]" (the stop string). For a chat model the whole prompt is the single user
message.

Post-processing: a leading "[BEGIN]" is dropped, the answer is cut at "[DONE]", and a markdown
fence, if any, gives the code.

Judging (`fastdllm.sandbox.judge`): the code, then `test_setup_code` (it may use the code's
classes: task 367 builds trees of its `Node`), run in the solution's process; the `test_list`
asserts run in the tests' process, where every name they read without defining (the function,
and the setup's trees) stands for the solution's. Built-in names stay built-in unless the
reference code defines them (task 126's function is called `sum`). It passes when every assert
holds.
"""

from __future__ import annotations

from .base import DataError, Doc, Task, apply_limit, read_jsonl
from .scoring import cut_at_stops, extract_fenced_code

TEST_IDS = range(11, 511)
FEWSHOT_IDS = (2, 3, 4)
STOP = ["[DONE]"]


def _clean(code: str) -> str:
    return code.replace("\r\n", "\n").rstrip()


def format_example(row: dict, code: str | None = None) -> str:
    tests = "\n".join(row["test_list"])
    text = (
        f"You are an expert Python programmer, and here is your task: {row['text']} "
        f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"
    )
    return text if code is None else f"{text}{_clean(code)}\n[DONE]"


def extract_code(completion: str) -> str:
    code = completion.lstrip()
    if code.startswith("[BEGIN]"):
        code = code[len("[BEGIN]") :]
    code = cut_at_stops(code, STOP)
    fenced = extract_fenced_code(code)
    if fenced is not None:
        code = fenced
    return code.strip("\n")


def _by_id(data_dir) -> dict[int, dict]:
    rows = read_jsonl("mbpp", data_dir, required=("task_id", "text", "code", "test_list"))
    return {int(r["task_id"]): r for r in rows}


class MBPPTask(Task):
    name = "mbpp"
    default_num_fewshot = 3
    max_num_fewshot = len(FEWSHOT_IDS)
    is_code = True
    default_timeout = 10.0
    description = "MBPP test (ids 11-510), 3-shot (ids 2-4), pass@1 in the sandbox"

    def load(self, data_dir=None, limit=None):
        rows = _by_id(data_dir)
        missing = [i for i in TEST_IDS if i not in rows]
        if missing:
            raise DataError(f"mbpp: the data file lacks test task ids {missing[:5]}{'...' if len(missing) > 5 else ''}")
        docs = [Doc(f"mbpp/{i}", n, rows[i], rows[i]["code"]) for n, i in enumerate(TEST_IDS)]
        return apply_limit(docs, limit)

    def fewshot(self, k, data_dir=None):
        if k == 0:
            return []
        rows = _by_id(data_dir)
        missing = [i for i in FEWSHOT_IDS[:k] if i not in rows]
        if missing:
            raise DataError(f"mbpp: the data file lacks few-shot task ids {missing}")
        return [rows[i] for i in FEWSHOT_IDS[:k]]

    def prompt_text(self, doc, shots):
        parts = [format_example(s, s["code"]) for s in shots]
        parts.append(format_example(doc.data))
        return "\n\n".join(parts)

    def stop_strings(self, chat):
        return list(STOP)

    def build_check(self, doc, completion):
        from ...sandbox import CodeCheck
        from ...sandbox.judge import remote_names, top_level_names

        d = doc.data
        tests = "\n".join(d["test_list"]) + "\n"
        return CodeCheck(
            solution=extract_code(completion),
            tests=tests,
            setup=d.get("test_setup_code") or "",
            remote=remote_names(tests, top_level_names(d["code"])),
            label=doc.id,
        )
