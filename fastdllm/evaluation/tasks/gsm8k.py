"""GSM8K (Cobbe et al. 2021): grade-school math word problems, 1319 test items.

Prompt (as lm-evaluation-harness's `gsm8k` task, which Fast-dLLM reports): k worked exemplars,
then the question, each as

    Question: <question>
    Answer: <worked solution ending "#### N">

separated by blank lines; the prompt ends with "Answer:". 5-shot by default, up to 8.

Exemplars: the first k rows of the GSM8K train split (`gsm8k_train.jsonl`, rows 0-7, solutions
verbatim with their <<calculator>> annotations). They are fixed, so every run and every model
sees the same prompt; the package ships only these 8 rows. For a chat model (tokenizer with a
chat_template) the whole prompt is the single user message.

Scoring: `extract_gsm8k_answer` (the number after "####", else the last number) compared after
`normalize_number` with the gold number after "####". The answer ends at "Question:" (the model
starting another exemplar) or at the first stop token.
"""

from __future__ import annotations

from .base import Doc, Task, apply_limit, read_jsonl, score_final_number
from .scoring import normalize_number

MAX_SHOTS = 8


def gold_number(answer: str) -> str:
    found = normalize_number(answer.split("####")[-1])
    if found is None:
        raise ValueError(f"no number after #### in {answer[-40:]!r}")
    return found


def format_example(question: str, answer: str | None = None) -> str:
    text = f"Question: {question}\nAnswer:"
    return text if answer is None else f"{text} {answer}"


class GSM8KTask(Task):
    name = "gsm8k"
    default_num_fewshot = 5
    max_num_fewshot = MAX_SHOTS
    description = "GSM8K test (1319), 5-shot, exact match of the final number"

    def load(self, data_dir=None, limit=None):
        rows = read_jsonl("gsm8k_test", data_dir, required=("question", "answer"))
        docs = [Doc(f"gsm8k/{i}", i, r, gold_number(r["answer"])) for i, r in enumerate(rows)]
        return apply_limit(docs, limit)

    def fewshot(self, k, data_dir=None):
        if k == 0:
            return []
        rows = read_jsonl("gsm8k_train", data_dir, required=("question", "answer"))
        if len(rows) < k:
            raise ValueError(f"num_fewshot: gsm8k_train has only {len(rows)} exemplars (asked {k})")
        return rows[:k]

    def prompt_text(self, doc, shots):
        parts = [format_example(s["question"], s["answer"]) for s in shots]
        parts.append(format_example(doc.data["question"]))
        return "\n\n".join(parts)

    def stop_strings(self, chat):
        return ["Question:"]

    def score_one(self, doc, completion):
        return score_final_number(doc, completion)
