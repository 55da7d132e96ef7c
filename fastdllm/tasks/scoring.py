"""Answer extraction shared by GSM8K-style tasks (gsm8k, arith)."""

from __future__ import annotations

import re

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
