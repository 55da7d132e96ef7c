"""The embedded model's tool-calling and JSON skill, through the server as a client sees it.

    python benchmarks/tool_calls.py [--model llada-arith] [--limit 100] [--seed 7] [--out FILE]

Questions: one-step stories drawn from `fastdllm.embedded.tool_data.one_step` with `--seed` (the generator
the tools mix trains on, so a story may repeat a training one; the tools are written in pydantic's
style with names and parameter names the framework tests use: `add`/`subtract`/`multiply`/
`divide` of `a` and `b`, and `Answer` with the story's item as its field). Per story and per
request kind, right means the call or object the story asks for, to the value:
- auto: the four operation tools offered, tool_choice auto: a call of the story's operation with
  its two numbers (a text answer counts wrong);
- named: tool_choice names the story's operation: its two numbers;
- required: only `Answer` offered, tool_choice required: the story's result;
- json_schema: response_format with the `Answer` schema: the story's result;
- follow-up: the history holds the call and the tool's result: an answer ending `#### <result>`.
Each request is a /v1/chat/completions call through FastAPI's test client (float32, the server's
default decoding, max_tokens 64). Prints and writes accuracy per kind and the mean completion tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from fastapi.testclient import TestClient

import fastdllm
from fastdllm import GenerationConfig
from fastdllm.embedded import tool_data
from fastdllm.server import ServerSettings, create_app
from fastdllm.text import tool_calls

TOOL_NAMES = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide"}


def schema(title: str, description: str, fields: list[str]) -> dict:
    """A pydantic model's JSON schema with integer fields bounded 0..1000."""
    return {
        "additionalProperties": False,
        "description": description,
        "properties": {f: {"maximum": 1000, "minimum": 0, "title": f.title(), "type": "integer"} for f in fields},
        "required": fields,
        "title": title,
        "type": "object",
    }


def tool(name: str, description: str, fields: list[str]) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema(name.title(), description, fields)},
    }


OPERATION_TOOLS = {op: tool(TOOL_NAMES[op], tool_data.OPERATIONS[op][1][0], ["a", "b"]) for op in TOOL_NAMES}


def requests_for(question: str, op: str, a: int, b: int, value: int, item: str):
    """(kind, request body, judge of the response's first choice)."""
    user = [{"role": "user", "content": question}]
    answer = tool("Answer", "The answer.", [item])

    def called(name, arguments):
        def judge(choice):
            calls = choice["message"].get("tool_calls") or []
            return (
                len(calls) == 1
                and calls[0]["function"]["name"] == name
                and json.loads(calls[0]["function"]["arguments"]) == arguments
            )

        return judge

    yield "auto", dict(messages=user, tools=list(OPERATION_TOOLS.values())), called(TOOL_NAMES[op], {"a": a, "b": b})
    yield (
        "named",
        dict(
            messages=user,
            tools=list(OPERATION_TOOLS.values()),
            tool_choice={"type": "function", "function": {"name": TOOL_NAMES[op]}},
        ),
        called(TOOL_NAMES[op], {"a": a, "b": b}),
    )
    yield "required", dict(messages=user, tools=[answer], tool_choice="required"), called("Answer", {item: value})

    def holds_value(choice):
        try:
            return json.loads(choice["message"]["content"]) == {item: value}
        except (TypeError, json.JSONDecodeError):
            return False

    yield (
        "json_schema",
        dict(
            messages=user,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "Answer", "schema": answer["function"]["parameters"], "strict": True},
            },
        ),
        holds_value,
    )
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": TOOL_NAMES[op], "arguments": json.dumps({"a": a, "b": b})},
    }
    history = user + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(value)},
    ]
    yield (
        "follow-up",
        dict(messages=history, tools=list(OPERATION_TOOLS.values())),
        lambda choice: (choice["message"]["content"] or "").strip().endswith(f"#### {value}"),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llada-arith")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = fastdllm.load(args.model, dtype="float32")
    app = create_app(model, tokenizer, ServerSettings("m", GenerationConfig()))
    r = random.Random(args.seed)
    right, tokens, total = {}, {}, 0
    with TestClient(app) as client:
        for _ in range(args.limit):
            question, op, a, b, value, item = tool_data.one_step(r)
            for kind, body, judge in requests_for(question, op, a, b, value, item):
                resp = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 64, "seed": 0, **body})
                resp.raise_for_status()
                out = resp.json()
                right[kind] = right.get(kind, 0) + bool(judge(out["choices"][0]))
                tokens[kind] = tokens.get(kind, 0) + out["usage"]["completion_tokens"]
            total += 1
    rows = {kind: {"accuracy": right[kind] / total, "completion_tokens": tokens[kind] / total} for kind in right}
    print(f"{args.model}: {total} stories (seed {args.seed})")
    for kind, row in rows.items():
        print(f"  {kind:12s} {100 * row['accuracy']:5.1f}%  {row['completion_tokens']:5.1f} tokens")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "limit": total,
                    "seed": args.seed,
                    "rows": rows,
                    "parser": tool_calls.parser_for_template(tokenizer.chat_template),
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
