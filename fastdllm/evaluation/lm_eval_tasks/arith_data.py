"""The `fastdllm_arith` task's splits for lm-evaluation-harness (its `custom_dataset`)."""

from __future__ import annotations


def splits(**_metadata):
    """test: the 1000 fixed test problems; train: the 16-problem few-shot pool."""
    import datasets

    # lm-eval loads this file alone, as a module outside any package: an absolute import
    from fastdllm.evaluation.tasks import arith

    def rows(problems):
        return datasets.Dataset.from_list([{"question": p.question, "answer": p.answer} for p in problems])

    return datasets.DatasetDict({"test": rows(arith.test_split()), "train": rows(arith.fewshot_pool())})
