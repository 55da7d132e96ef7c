"""The house has one direction: the import graph of `fastdllm/`, read from the modules' own
import statements (those inside functions too), has no cycle and no arrow from a lower layer to
a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastdllm"

# Lowest first. A module belongs to the first layer with a prefix that names it or its package
# ("fastdllm", the package's own __init__, names itself only: a new module must be placed here).
LAYERS = [
    ("declarations", ["fastdllm.config", "fastdllm.version", "fastdllm.tokenizer", "fastdllm.text", "fastdllm.tool_calls",
                      "fastdllm.tool_schema",
                      "fastdllm.tasks.scoring", "fastdllm.sandbox", "fastdllm.live_view", "fastdllm.server.guard",
                      "fastdllm.server.metrics", "fastdllm.server.schema"]),
    ("cache", ["fastdllm.cache"]),
    ("models", ["fastdllm.models", "fastdllm.quant", "fastdllm.loading"]),
    ("engine", ["fastdllm.cache_policies", "fastdllm.unmasking", "fastdllm.constraints", "fastdllm.policies", "fastdllm.decoder",
                "fastdllm.generation",
                "fastdllm.likelihood"]),
    ("text front ends", ["fastdllm.textgen", "fastdllm.chat", "fastdllm.tasks", "fastdllm.embedded",
                         "fastdllm.drills", "fastdllm.tool_data", "fastdllm.train_data", "fastdllm.server.incremental"]),
    ("serving, evaluation, bench, training", ["fastdllm.server", "fastdllm.evaluate", "fastdllm.bench",
                                              "fastdllm.train", "fastdllm.lm_eval_plugin", "fastdllm.lm_eval_tasks"]),
    ("commands and the package's front door", ["fastdllm.commands", "fastdllm.cli", "fastdllm.__main__",
                                               "fastdllm"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                if f"{target}.{a.name}" in known:
                    found.add(f"{target}.{a.name}")
                elif target in known:
                    found.add(target)
    found.discard(name)
    return found


def layer(name: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or (p != "fastdllm" and name.startswith(p + ".")) for p in prefixes):
            return i
    raise AssertionError(f"{name} has no layer: add it to LAYERS")


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_no_import_cycle():
    edges, state, cycles = graph(), {}, []

    def visit(v, path):
        state[v] = "open"
        for w in sorted(edges[v]):
            if state.get(w) == "open":
                cycles.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = "done"

    for v in sorted(edges):
        if v not in state:
            visit(v, [v])
    assert cycles == []


def test_every_arrow_points_down():
    upward = [f"{a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})"
              for a, targets in graph().items() for b in targets if layer(b) > layer(a)]
    assert upward == []
