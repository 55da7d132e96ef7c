"""Training rows for the embedded model's tool-calling and JSON skill (the `tools` source of
`fastdllm.embedded.train_data`): a one-step `arith` story, tools of the shapes frameworks send, and the
answer in each form the server may ask it for.

- **Tools** as OpenAI function specs with a parameters schema in the styles frameworks write
  (pydantic's titles and bounds, `additionalProperties`, OpenAI's plain style, `strict`). An
  *operation* tool (add, subtract, multiply, divide under several names, two integer parameters
  under several names) takes the story's two numbers in order; an *answer* tool (pydantic-ai's
  `final_result`, instructor's and langchain's model name) has one integer field that takes the
  story's result. Parameter names of the two kinds never overlap, so a key tells them apart.
  The embedded template shows only each tool's name, parameter names and description; the
  schema styles matter to a template that writes the schemas out (Hermes', Qwen's).
- **Answers**, chosen the way the server decodes (`fastdllm.text.tool_calls`): a Hermes call
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (tool_choice auto: the story's
  operation if offered, else the answer tool), the bare arguments of one offered tool (a named
  tool_choice, where the grammar writes the keys and the model the values), a one-call array
  `[{"name": ..., "parameters": {...}}]` (tool_choice required), and after a call and its `tool`
  result the result in an answer's last line (`#### N`).
- **JSON without tools** (`response_format`): the story's question and a one-key object holding
  the result, `{"apples": 8}`, with keys a schema might name.

JSON is written as `json.dumps` writes it, the spacing `constraints.JSON_STYLE` enforces.
"""

from __future__ import annotations

import json
import random

from ..evaluation.tasks import arith

# operation -> (tool names, descriptions, the result of a and b)
OPERATIONS = {
    "add": (
        ["add", "Add", "add_numbers", "plus", "sum_two"],
        ["Add two numbers.", "Return a + b.", "Sum of two integers."],
        lambda a, b: a + b,
    ),
    "sub": (
        ["subtract", "Subtract", "minus", "sub"],
        ["Subtract the second number from the first.", "Return a - b."],
        lambda a, b: a - b,
    ),
    "mul": (["multiply", "Multiply", "times", "mul"], ["Multiply two numbers.", "Return a * b."], lambda a, b: a * b),
    "div": (
        ["divide", "Divide", "div"],
        ["Divide the first number by the second.", "Return a / b."],
        lambda a, b: a // b,
    ),
}
OPERAND_NAMES = [("a", "b"), ("x", "y"), ("first", "second"), ("left", "right"), ("num1", "num2"), ("n", "m")]
ANSWER_TOOL_NAMES = ["Answer", "final_result", "submit_answer", "Result", "Output", "report_answer", "Response"]
ANSWER_FIELDS = ["answer", "result", "total", "value", "count", "number", "amount"]  # and the story's item
# Shares of the answer forms for a question with tools; the rest are follow-ups after a call.
FORMS = {"call": 0.45, "arguments": 0.25, "array": 0.15, "followup": 0.15}
P_JSON_WITHOUT_TOOLS = 0.25


def one_step(r: random.Random) -> tuple[str, str, int, int, int, str]:
    """A one-event story in the phrasing of `arith`'s running totals: (question, operation, first
    number, second number, result, item)."""
    name, item = r.choice(arith.NAMES), r.choice(arith.ITEMS)
    he = arith.PRONOUN[name].capitalize()
    op = r.choice(list(OPERATIONS))
    if op == "add":
        a, b = r.randint(2, 40), r.randint(2, 10)
        event = f"{he} {r.choice(['buys', 'finds', 'gets'])} {b} more {item}."
    elif op == "sub":
        a, b = r.randint(4, 50), r.randint(2, 10)
        b = min(b, a - 1)
        event = f"{he} gives {b} {item} to {r.choice([n for n in arith.NAMES if n != name])}."
    elif op == "mul":
        a, b = r.randint(2, 12), r.randint(2, 4)
        event = {2: f"Then the number of {item} doubles.", 3: f"Then the number of {item} triples."}.get(
            b, f"Then {he.lower()} ends up with {b} times as many {item}."
        )
    else:
        b = r.randint(2, 5)
        a = b * r.randint(2, 10)
        event = f"{he} splits the {item} into {b} equal piles and keeps one pile."
    value = OPERATIONS[op][2](a, b)
    return f"{name} has {a} {item}. {event} How many {item} does {name} have now?", op, a, b, value, item


def _integer(r: random.Random, key: str, style: str) -> dict:
    spec = {"type": "integer"}
    if style == "pydantic":
        spec = {"title": key.replace("_", " ").title(), "type": "integer"}
        if r.random() < 0.5:
            spec = {"maximum": r.choice([100, 1000, 10000]), "minimum": 0, **spec}
    elif r.random() < 0.3:
        spec["description"] = r.choice(["A whole number.", "The number.", f"The {key}."])
    return spec


def _tool(r: random.Random, name: str, description: str, keys: list[str]) -> dict:
    style = r.choice(["pydantic", "plain"])
    params = {"properties": {k: _integer(r, k, style) for k in keys}, "required": list(keys)}
    if style == "pydantic":
        params = {
            **({"additionalProperties": False} if r.random() < 0.5 else {}),
            **params,
            "title": name,
            "type": "object",
        }
        if r.random() < 0.4:
            params = {"description": description, **params}
    else:
        params = {"type": "object", **params, **({"additionalProperties": False} if r.random() < 0.3 else {})}
    function = {"name": name, "description": description, "parameters": params}
    if r.random() < 0.2:
        function["strict"] = True
    return {"type": "function", "function": function}


def _operation_tool(r: random.Random, op: str) -> tuple[dict, tuple[str, str]]:
    names, descriptions, _ = OPERATIONS[op]
    keys = r.choice(OPERAND_NAMES)
    return _tool(r, r.choice(names), r.choice(descriptions), list(keys)), keys


def _answer_tool(r: random.Random, item: str) -> tuple[dict, str]:
    key = r.choice(ANSWER_FIELDS + [item, item])
    return _tool(
        r, r.choice(ANSWER_TOOL_NAMES), r.choice(["The answer.", "The final answer.", "Respond with this."]), [key]
    ), key


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_example(r: random.Random) -> dict:
    """One example: `messages`, `tools` (None for a JSON answer without tools), the `answer` text,
    its `form` (FORMS, or "json"), and the story's `op`, `a`, `b` and `value`."""
    question, op, a, b, value, item = one_step(r)
    ex = dict(messages=[{"role": "user", "content": question}], tools=None, op=op, a=a, b=b, value=value)
    if r.random() < P_JSON_WITHOUT_TOOLS:
        key = r.choice(ANSWER_FIELDS + [item, item])
        return dict(ex, answer=_dumps({key: value}), form="json")
    # what the tools are: the story's operation, another operation, an answer tool, in random order
    offered = []  # (tool, arguments)
    if r.random() < 0.7:
        tool, keys = _operation_tool(r, op)
        offered.append((tool, dict(zip(keys, (a, b)))))
    if not offered or r.random() < 0.35:
        tool, key = _answer_tool(r, item)
        offered.append((tool, {key: value}))
    if r.random() < 0.3:
        other = r.choice([o for o in OPERATIONS if o != op])
        tool, keys = _operation_tool(r, other)
        offered.append((tool, dict(zip(keys, (a, b)))))
    r.shuffle(offered)
    form = r.choices(list(FORMS), weights=list(FORMS.values()))[0]
    # auto: the story's operation when offered, else the answer tool
    chosen = next((o for o in offered if o[0]["function"]["name"] in OPERATIONS[op][0]), None) or next(
        o for o in offered if len(o[1]) == 1
    )
    name, arguments = chosen[0]["function"]["name"], chosen[1]
    messages = ex["messages"]
    if form == "arguments":
        answer = _dumps(r.choice(offered)[1])  # a named tool_choice may force any offered tool
    elif form == "array":
        answer = _dumps([{"name": name, "parameters": arguments}])
    elif form == "call":
        answer = "<tool_call>" + _dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    else:  # the call made, its result returned: the operation's result, or the answer tool's argument
        messages = messages + [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": str(value)},
        ]
        answer = f"The result is {value}.\n#### {value}"
    return dict(ex, messages=messages, tools=[t for t, _ in offered], answer=answer, form=form)


def tool_row(r: random.Random, tokenizer) -> tuple[list[int], list[int]]:
    """One `tool_example` as (prompt ids, answer ids ending in the end-of-turn token)."""
    ex = tool_example(r)
    return (
        tokenizer.encode_chat(ex["messages"], tools=ex["tools"]),
        tokenizer.encode(ex["answer"], add_special_tokens=False) + [tokenizer.token_to_id("<|eot_id|>")],
    )
