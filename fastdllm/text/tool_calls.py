"""Tool calling as the OpenAI API and vLLM shape it: tools into the prompt, calls out of the answer.

- **Prompt**: the tools go to the model's own chat template (templates take `tools`); a template
  that never reads them gets them in a system message instead, written in the Hermes convention,
  so the model is told what it may call either way. The history's
  assistant `tool_calls` (arguments as JSON strings in the API) reach the template with the
  arguments as objects, as transformers' templates expect; `tool` messages pass as they are.
- **Parsing** (`PARSERS`): "hermes" (Qwen2.5, Hermes, most Qwen-based dLLMs: each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and "llama3_json" (Llama 3.1: the
  answer is a JSON object `{"name": ..., "parameters": {...}}`, several separated by `;`, after an
  optional `<|python_tag|>`). A model's parser is read from its template, or chosen by the server's
  `--tool-call-parser`. Text outside the calls stays the message's content.
- **tool_choice**: "none" (no tools in the prompt, nothing parsed), "auto" (parsed when the model
  calls), "required" and a named function: the answer is *constrained* to calls (a JSON array of
  `{"name", "parameters"}` objects of the given tools, or the named function's parameters), as
  vLLM does with guided decoding, so a call comes back whatever the model's skill.
"""

from __future__ import annotations

import json
import re
import uuid

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_tools(tools, tool_choice) -> None:
    """A ValueError naming the field for a malformed `tools` or `tool_choice`."""
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise ValueError(
                f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
    if tool_choice in (None, "none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise ValueError("tool_choice: must be none, auto, required or {'type': 'function', 'function': {'name': ...}}")
    if name not in tool_names(tools):
        raise ValueError(f"tool_choice: no tool named {name!r} in tools")


def parser_for_template(template: str | None) -> str:
    """The call format a chat template teaches its model (Hermes unless it is Llama 3.1's)."""
    if template and ("<|python_tag|>" in template or "ipython" in template) and "<tool_call>" not in template:
        return "llama3_json"
    return "hermes"


def _call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    calls, spans = [], []
    for m in HERMES_CALL.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
            spans.append(m.span())
    if not calls:
        return text, []
    content, last = "", 0
    for a, b in spans:
        content, last = content + text[last:a], b
    content = (content + text[last:]).strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for part in body.split(";"):
        part = part.strip()
        if not part:
            continue
        try:
            call = _call(json.loads(part))
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def forced_schema(tools: list[dict], tool_choice) -> dict | None:
    """The JSON schema an answer must follow for `tool_choice` required / named (None otherwise)."""
    if tool_choice == "required":
        items = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "parameters"],
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": t["function"].get("parameters") or {"type": "object"},
                },
            }
            for t in tools
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object"}
    return None


def forced_calls(text: str, tool_choice) -> list[dict]:
    """The calls of an answer constrained by `forced_schema` (empty if it ran out before closing)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(tool_choice, dict):
        return [{"name": tool_choice["function"]["name"], "arguments": value}]
    return [c for c in (_call(v) for v in value) if c is not None]


def openai_calls(calls: list[dict]) -> list[dict]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]


def template_messages(messages: list[dict]) -> list[dict]:
    """API messages as chat templates take them: None values dropped (as transformers does), an
    assistant's tool-call arguments as objects."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def tools_system_message(tools: list[dict]) -> dict:
    """The tools for a template that does not render them, in the Hermes convention."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return {
        "role": "system",
        "content": "You can call these functions. The function signatures are inside <tools></tools>:\n<tools>\n"
        f"{listed}\n</tools>\nTo call a function, answer with a JSON object of its name and arguments "
        'inside <tool_call></tool_call>: <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>',
    }


def template_reads_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template
