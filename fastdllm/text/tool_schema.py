"""A Python function as the JSON schema of a tool, by the rules of transformers' `get_json_schema`,
so that `apply_chat_template(..., tools=[a_function])` renders the same with or without
transformers installed.

- The name is the function's `__name__`; the description is the docstring up to its first
  `Args:`, `Returns:` or `Raises:`.
- Parameters come from the signature: each needs a type hint and a description under `Args:`
  (Google style, `name: text` or `name (type): text`, continued on deeper-indented lines); those
  without a default are `required`. A leading `self` / `cls` without a hint is skipped.
- Types: int integer, float number, str string, bool boolean, None null, `Any` no constraint;
  `list[X]` an array of X, `tuple[X, Y]` an array with `prefixItems`, `dict[str, X]` an object
  with `additionalProperties`; `Literal[...]` and Enum classes an `enum` (with the JSON types of
  their values); a Union of plain types a list of types, of others `anyOf`, `Optional` adds
  `"nullable": true`. A description ending in `(choices: [...])` (a JSON list) becomes an `enum`.
- A return hint, where it converts, is the schema's `return`, with the `Returns:` text.

*Deliberate difference*: transformers also maps `PIL.Image` to `{"type": "image"}` and
`torch.Tensor` to `{"type": "audio"}`; the text layer knows neither and refuses them like any other
class. Errors are `ValueError`s naming the function and the parameter.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_PLAIN = {
    **{t: {"type": name} for t, name in _SCALARS.items()},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}

_SECTION = re.compile(r"Args:|Returns:|Raises:")
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(?:Returns:|Raises:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(?:Raises:|\Z)", re.DOTALL)
_ARG_HEAD = re.compile(r"([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*)")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def function_schema(func: Callable) -> dict:
    """`{"type": "function", "function": {"name", "description", "parameters"[, "return"]}}`."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ValueError(f"tools: {name} has no docstring to describe it")
    doc = doc.strip()
    description, arg_texts, returns = _parse_docstring(doc)
    parameters = _parameters(func, name)
    returned = parameters["properties"].pop("return", None)
    if returned is not None and returns is not None:
        returned["description"] = returns
    for arg, schema in parameters["properties"].items():
        if arg not in arg_texts:
            raise ValueError(f"tools: {name}'s docstring has no description of its argument {arg!r}")
        text = arg_texts[arg]
        choices = _CHOICES.search(text)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[: choices.start()].strip()
        schema["description"] = text
    out = {"name": name, "description": description, "parameters": parameters}
    if returned is not None:
        out["return"] = returned
    return {"type": "function", "function": out}


def as_tool_schemas(tools):
    """`tools` with every callable replaced by its schema (None stays None)."""
    if tools is None:
        return None
    return [function_schema(t) if callable(t) else t for t in tools]


def _parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    head = _SECTION.search(doc)
    description = (doc[: head.start()] if head else doc).strip()
    args: dict[str, str] = {}
    block = _ARGS.search(doc)
    if block:
        entries: list[tuple[str, str, list[str]]] = []  # (indent, name, lines)
        for line in (ln for ln in block.group(1).split("\n") if ln.strip()):
            m = _ARG_HEAD.fullmatch(line)
            # a new entry unless it is indented deeper than the entry it would follow
            if m and not (entries and len(m.group(1)) > len(entries[-1][0]) and m.group(1).startswith(entries[-1][0])):
                entries.append((m.group(1), m.group(2), [m.group(3)]))
            elif entries:
                entries[-1][2].append(line)
        for _, name, lines in entries:
            args[name] = re.sub(r"\s*\n+\s*", " ", "\n".join(lines).strip())
    returns = _RETURNS.search(doc)
    return description, args, returns.group(1).strip() if returns else None


def _parameters(func: Callable, name: str) -> dict:
    hints = typing.get_type_hints(func)
    params = list(inspect.signature(func).parameters.values())
    skip = (
        params[0].name
        if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty
        else None
    )
    required = []
    for p in params:
        if p.name == skip:
            continue
        if p.annotation is inspect.Parameter.empty:
            raise ValueError(f"tools: {name}'s argument {p.name!r} has no type hint")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties = {}
    for arg, hint in hints.items():
        if arg == skip:
            continue
        if arg == "return":  # never generated: a return hint that does not convert is left out
            try:
                properties[arg] = _type_schema(hint, name, arg)
            except ValueError:
                pass
        else:
            properties[arg] = _type_schema(hint, name, arg)
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _enum(values: list, name: str, arg: str) -> dict:
    if any(type(v) not in _SCALARS for v in values):
        raise ValueError(f"tools: {name}'s argument {arg!r} lists values that are not JSON scalars: {values!r}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _type_schema(hint, name: str, arg: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [m.value for m in hint]
            if not values:
                raise ValueError(f"tools: {name}'s argument {arg!r}: the Enum {hint.__name__} has no members")
            return _enum(values, name, arg)
        if hint in _PLAIN:
            return dict(_PLAIN[hint])
        raise ValueError(
            f"tools: {name}'s argument {arg!r} has the type {hint!r}, which has no JSON schema "
            "(basic types, Enum, Literal, and list, tuple, dict and Union of those); pass the tool's "
            "schema as a dict instead"
        )
    if origin is typing.Union or origin is types.UnionType:
        parts = [_type_schema(t, name, arg) for t in args if t is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            kinds = sorted({p["type"] for p in parts})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        return _enum(list(args), name, arg)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], name, arg)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise ValueError(
                f"tools: {name}'s argument {arg!r}: a tuple of one element or of any length has no "
                "JSON schema here; use list[...] (or the element itself)"
            )
        return {"type": "array", "prefixItems": [_type_schema(t, name, arg) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _type_schema(args[1], name, arg)
        return out
    raise ValueError(f"tools: {name}'s argument {arg!r} has the type {hint!r}, which has no JSON schema")
