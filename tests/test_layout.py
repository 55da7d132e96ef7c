"""The house has one direction: the import graph of `fastdllm/`, read from the modules' own
import statements (those inside functions too), has no cycle and no arrow from a lower layer to
a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastdllm"

# Lowest first: the packages, each a layer of the architecture (the package's own __init__,
# "fastdllm", names itself only).
LAYERS = [
    ("declarations", ["fastdllm.config", "fastdllm.version"]),
    ("text and the sandbox, without torch", ["fastdllm.text", "fastdllm.sandbox"]),
    ("models", ["fastdllm.models", "fastdllm.quant"]),
    ("engine", ["fastdllm.engine"]),
    (
        "evaluation, serving, the embedded models",
        [
            "fastdllm.evaluation",
            "fastdllm.tuning",
            "fastdllm.server",
            "fastdllm.embedded",
            "fastdllm.lm_eval_plugin",
            "fastdllm.demo",
        ],
    ),
    ("the command line and the package's front door", ["fastdllm.cli", "fastdllm.__main__", "fastdllm"]),
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
                cycles.append(path[path.index(w) :] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = "done"

    for v in sorted(edges):
        if v not in state:
            visit(v, [v])
    assert cycles == []


def test_every_arrow_points_down():
    upward = [
        f"{a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})"
        for a, targets in graph().items()
        for b in targets
        if layer(b) > layer(a)
    ]
    assert upward == []


def test_the_text_layer_and_the_sandbox_import_no_torch():
    """Importing them pulls in no torch: they serve torch-free processes (the sandbox's judges, a
    tokenizer-only client). A function may import it when asked for tensors (return_tensors="pt")."""
    heavy = {"torch", "numpy"}
    for name, path in modules().items():
        if layer(name) > 1:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            assert not any(n.split(".")[0] in heavy for n in names), (name, names)


def test_every_named_policy_class_registers_where_it_is_defined():
    """The config declares names only; the classes they name register themselves in the engine's
    registries, so the layering test above sees every arrow (no "module:Class" strings)."""
    from fastdllm import config
    from fastdllm.engine import policies, registry  # noqa: F401 - policies: the built-ins registered

    for kind in ("CACHE_POLICIES", "REFRESH_RULES", "SELECTION_RULES", "PROPOSALS"):
        names, classes = getattr(config, kind), getattr(registry, kind)
        for name in names:
            assert classes[name].name == name
    for module in (PACKAGE / "config").glob("*.py"):
        source = module.read_text(encoding="utf-8")
        assert "import_module" not in source and "fastdllm.engine" not in source
        assert "GenerationConfig.__init__ =" not in source
