"""HumanEval (Chen et al. 2021): 164 Python functions to complete, scored by pass@1.

Prompt, 0-shot (as Fast-dLLM reports): a model without a chat template gets the function's
`prompt` (signature + docstring) as is and continues it; a chat model gets one user message
asking to complete the function, with the prompt in a ```python fence.

Post-processing (`extract_program`), in this order:
1. a markdown fence in the answer: its code (the block that defines the entry point, if any);
2. the answer echoes the whole prompt: what follows the echo is the body;
3. the answer defines the entry point itself (`def <entry_point>(`): it is the full function;
   the prompt's imports are put before it and top-level test code (`if __name__`, `print(`,
   `assert`) is cut off;
4. otherwise the answer continues the prompt (a function body): it is cut at the first of the
   Codex stop sequences `\\ndef `, `\\nclass `, `\\nif __name__`, `\\nprint(`, `\\n#` (these are
   also the stop strings of generation for models without a chat template) and appended to the
   prompt.

Judging (`fastdllm.sandbox.judge`): the function runs in the solution's process; the task's
`test` (which defines `check`) and `check(<entry_point>)` run in the tests' process after the
prompt itself (trusted: it defines helpers the tests use, e.g. `poly`, `encode_cyclic`), with
`<entry_point>` standing for the solution's function. It passes when `check` returns.
"""

from __future__ import annotations

import re

from .base import Doc, Task, apply_limit, read_jsonl
from .scoring import cut_at_stops, extract_fenced_code

STOP_SEQUENCES = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
FULL_FUNCTION_TAIL = ["\nif __name__", "\nprint(", "\nassert ", "\n```"]

CHAT_INSTRUCTION = (
    "Complete the following Python function. Answer with the whole function in one "
    "```python code block.\n\n```python\n{prompt}```"
)


def prompt_imports(prompt: str) -> str:
    lines = [ln for ln in prompt.splitlines() if re.match(r"^(import |from \S+ import )", ln)]
    return "\n".join(lines) + ("\n\n" if lines else "")


def extract_program(prompt: str, entry_point: str, completion: str) -> str:
    """The function's code (without its tests) from the model's answer: see the module docstring."""
    code = completion
    fenced = extract_fenced_code(code, must_contain=f"def {entry_point}")
    if fenced is not None:
        code = fenced
    if prompt.strip() and prompt.strip() in code:  # the prompt is echoed: keep what follows it
        rest = code[code.index(prompt.strip()) + len(prompt.strip()) :]
        return prompt.rstrip("\n") + cut_at_stops(rest, STOP_SEQUENCES)
    if re.search(rf"^def {re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return prompt_imports(prompt) + cut_at_stops(code, FULL_FUNCTION_TAIL)
    return prompt + cut_at_stops(code, STOP_SEQUENCES)


class HumanEvalTask(Task):
    name = "humaneval"
    default_num_fewshot = 0
    max_num_fewshot = 0
    is_code = True
    default_timeout = 10.0
    description = "HumanEval (164), 0-shot, pass@1 in the sandbox"

    def load(self, data_dir=None, limit=None):
        rows = read_jsonl("HumanEval", data_dir, required=("task_id", "prompt", "entry_point", "test"))
        docs = [Doc(r["task_id"], i, r, r.get("canonical_solution", "")) for i, r in enumerate(rows)]
        return apply_limit(docs, limit)

    def prompt_text(self, doc, shots):
        return doc.data["prompt"]

    def chat_content(self, doc, shots):
        return CHAT_INSTRUCTION.format(prompt=doc.data["prompt"])

    def stop_strings(self, chat):
        # A chat model answers with a whole function in a fence: "\ndef " would cut it.
        return [] if chat else list(STOP_SEQUENCES)

    def build_check(self, doc, completion):
        from ...sandbox import CodeCheck

        d = doc.data
        return CodeCheck(
            solution=extract_program(d["prompt"], d["entry_point"], completion),
            tests=f"{d['test']}\n\ncheck({d['entry_point']})\n",
            remote=(d["entry_point"],),
            prelude=d["prompt"],
            label=doc.id,
        )
