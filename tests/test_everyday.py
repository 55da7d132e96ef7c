"""The `everyday` generator (held out by construction), its tasks, plain-prompt evaluation and the
`talk` training rows."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from fastdllm.embedded import train, train_data
from fastdllm.evaluation.harness import evaluate
from fastdllm.evaluation.tasks import arith, everyday

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def _shape(question: str) -> str:
    """The question's wording with its numbers and entities blanked out."""
    words = set(
        itertools.chain(
            *everyday.NAMES,
            *everyday.ITEMS,
            *everyday.CONTAINERS,
            *everyday.PRICED,
            *everyday.VEHICLES,
            *everyday.WORDS.values(),
        )
    )
    out = re.sub(r"\d+", "N", question)
    for w in sorted(words, key=len, reverse=True):
        out = re.sub(rf"\b{re.escape(w)}(e?s)?\b", "E", out, flags=re.IGNORECASE)
    return out


def test_everyday_test_split_is_fixed_correct_and_worked():
    test = everyday.test_split()
    assert len(test) == everyday.TEST_SIZE == len({p.question for p in test})
    everyday._cache.clear()
    assert [p.question for p in everyday.test_split()[:20]] == [p.question for p in test[:20]]
    for p in test:
        lines = p.answer.split("\n")
        assert lines[-1] == f"#### {p.value}" and 0 <= p.value <= everyday.MAX_VALUE
        equations = [EQUATION.search(line) for line in lines[:-1]]
        for m in filter(None, equations):
            a, op, b, c = m.groups()
            assert OPS[op](int(a), int(b)) == int(c) and (op != "/" or int(a) % int(b) == 0), p
        assert int(next(m for m in reversed(equations) if m).group(4)) == p.value  # the last step is the answer
    steps = {len(p.answer.split("\n")) - 1 for p in test}
    assert {1, 2, 3, 4} <= steps  # one- to four-step problems (the chain also states its start)


@pytest.mark.slow
def test_everyday_is_held_out_in_wording_and_entities():
    test = everyday.test_split()
    train_problems = list(itertools.islice(everyday.train_stream(0), 20000))
    train_names, test_names = set(everyday.NAMES[0]), set(everyday.NAMES[1])
    assert not train_names & test_names and not set(everyday.ITEMS[0]) & set(everyday.ITEMS[1])
    tokens = lambda q: set(re.findall(r"[A-Za-z]+", q))  # noqa: E731
    assert not any(tokens(p.question) & test_names for p in train_problems)
    assert not any(tokens(p.question) & set(everyday.ITEMS[1]) for p in train_problems)
    # no test question has a training question's wording, numbers and entities aside; a bare
    # calculation is the one shape a phrasing of only numbers can share, and its phrasings differ too
    train_shapes = {_shape(p.question) for p in train_problems}
    assert not [p.question for p in test if _shape(p.question) in train_shapes]
    # every operation and most phrasing kinds appear in both splits
    for word in ("plus", "times", "half", "quarter", "dollars", "hour", "years", "minus", "divided"):
        assert any(word in p.question.lower() for p in test), word
        assert any(word in p.question.lower() for p in train_problems), word


def test_numbers_in_words_and_distractors_appear():
    problems = list(itertools.islice(everyday.train_stream(1), 3000))
    assert sum(bool(re.search(r"\b(twelve|seven|twenty|three)\b", p.question)) for p in problems) > 50
    assert sum("sunny" in p.question or "o'clock" in p.question for p in problems) > 50


def test_plain_prompt_evaluation(tiny_llada, tokenizer, tmp_path):
    log = tmp_path / "samples.jsonl"
    r = evaluate(
        tiny_llada,
        tokenizer,
        "everyday-probe",
        limit=2,
        batch_size=2,
        chat_template=False,
        log_samples=log,
        config=None,
    )
    assert r["chat_template"] is False and r["num_samples"] == 2
    first = log.read_text().splitlines()[0]
    assert '"prompt": "Question: Tom has 5 apples.' in first and "<|" not in first
    assert evaluate(tiny_llada, tokenizer, "everyday", limit=1, batch_size=1)["chat_template"] is True

    class NoTemplate:
        chat_template = None

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    with pytest.raises(ValueError, match="chat_template"):
        evaluate(tiny_llada, NoTemplate(), "everyday", limit=1, chat_template=True)


def test_talk_rows_cover_every_format_and_no_test_question(tokenizer):
    eot, eos = tokenizer.token_to_id("<|eot_id|>"), tokenizer.eos_token_id
    bos = tokenizer.token_to_id("<|startoftext|>")
    held = {p.question for p in everyday.test_split()} | arith.held_out_questions()
    held_text = set(train_data.docstrings(held_out=True))
    r, streams, kinds = random.Random(0), None, set()
    streams = train_data.talk_streams(r)
    for _ in range(600):
        prompt, answer = train_data.talk_row(r, tokenizer, 64, streams)
        text = tokenizer.decode(prompt)
        chat = prompt[0] == bos
        assert answer[-1] == (eot if chat else eos) and eot not in answer[:-1]
        if not chat:
            kinds.add("plain-qa" if text.startswith("Question: ") else "plain")
            assert tokenizer.decode(answer[:-1]).startswith(" ")  # a completion continues after a space
        else:
            kinds.add("chat2" if prompt.count(eot) >= 2 else "chat")
        assert not any(q in text for q in held)
        assert not any(t.startswith(text.strip()) for t in held_text if len(text) > 40)
    assert kinds == {"plain-qa", "plain", "chat", "chat2"}
    assert train_data.docstrings() and held_text and not set(train_data.docstrings()) & held_text
    assert all(
        p.answer.rstrip().split("\n")[-1].startswith("####") and "<<" not in p.answer for p in train_data.gsm8k_easy()
    )


def test_talk_batches_are_deterministic(tokenizer):
    a = train.make_batch(tokenizer, 3, 26, 4096, "talk")
    b = train.make_batch(tokenizer, 3, 26, 4096, "talk")
    assert all((x == y).all() for x, y in zip(a, b))
    ids, starts = a
    assert ids.shape[1] >= 64 and (starts > 0).all()
