"""Build the training-only data files bundled in fastdllm/evaluation/data/ (see its README.md).

    python tools/build_training_data.py --gsm8k-train PATH/TO/gsm8k_train.jsonl

- gsm8k_train_easy.jsonl.gz: the rows of GSM8K's train split (MIT) whose worked answer has at
  most three calculator steps and whose numbers are all whole and at most 100, unchanged.
- docstrings.jsonl.gz: paragraphs of the docstrings of Python's standard library (PSF licence)
  of the modules in MODULES, each {"module", "text"}: plain ASCII prose of 120-700 characters.
  `fastdllm.embedded.train` trains on the modules of TRAIN_MODULES and holds out the others.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "fastdllm" / "data"
MODULES = [
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "os",
    "pathlib",
    "pickle",
    "platform",
    "pprint",
    "queue",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tkinter",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
    "zoneinfo",
    "configparser",
    "ftplib",
    "imaplib",
    "smtplib",
    "optparse",
    "trace",
    "turtle",
    "wave",
]


def easy_gsm8k(path: Path) -> list[str]:
    keep = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps = re.findall(r"<<([^>]*)>>", row["answer"])
        numbers = re.findall(r"\d+(?:\.\d+)?", (row["question"] + row["answer"]).replace(",", ""))
        if len(steps) <= 3 and all(float(n) <= 100 and float(n).is_integer() for n in numbers):
            keep.append(line)
    return keep


def paragraphs(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return []
    docs = [inspect.getdoc(module) or ""]
    for _, obj in sorted(vars(module).items()):
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == module_name:
            docs.append(inspect.getdoc(obj) or "")
    out = []
    for doc in docs:
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(para.split())
            if 120 <= len(text) <= 700 and text.isascii() and not re.search(r">>>|[{}\\|]|::", text):
                out.append(text)
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gsm8k-train", type=Path, required=True)
    args = ap.parse_args()
    rows = easy_gsm8k(args.gsm8k_train)
    with gzip.GzipFile(DATA / "gsm8k_train_easy.jsonl.gz", "wb", mtime=0) as f:
        f.write(("\n".join(rows) + "\n").encode())
    docs = [json.dumps({"module": m, "text": t}) for m in MODULES for t in paragraphs(m)]
    with gzip.GzipFile(DATA / "docstrings.jsonl.gz", "wb", mtime=0) as f:
        f.write(("\n".join(docs) + "\n").encode())
    print(f"{len(rows)} GSM8K rows, {len(docs)} docstring paragraphs")


if __name__ == "__main__":
    main()
