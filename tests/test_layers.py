"""The package layering of docs/architecture.md, checked on the source: no import cycle inside `chatapp`, none running up.

For the layers every `import` / `from ... import` of a `chatapp` module counts, including the ones inside
functions and under `TYPE_CHECKING` (a deferred import is still a dependency): a package may import its own
modules, the base modules and packages on lower levels; packages on one level do not import each other. So no
cycle between packages is possible. Between the modules of one package, the imports that run when a module is
imported (not deferred into a function or under `TYPE_CHECKING`) must not form a cycle either.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import chatapp

ROOT = Path(chatapp.__file__).resolve().parent

# Lowest first. `chat` imports the tool protocol (`tools.base`) and nothing above it; the engine takes a chat format
# through `ChatFormatLike` without importing `chat`, so the two share a level.
LEVELS: list[set[str]] = [
    {"errors", "special_tokens", "compute_saved", "byte_level", "lifecycle"},
    {"routing_levels"},  # a requested level is checked in one place, which raises the errors' `SettingsError`
    {"store"},  # everything written under the data directory goes through it (docs/architecture.md)
    {"validation"},
    {"settings"},
    {"tools", "trie", "ttfa", "stt"},
    {"engine", "chat"},
    {"models"},
    {"training"},  # build-time fitting (`chatapp route`); the runtime never imports it
    {"recipes"},
    {"serve"},  # the OpenAI-compatible server over an engine it is given, and its light client (the TUI's too)
    {"batch", "ui"},
    {"cli"},  # the command line: its table, a module per command, rendering, errors, shared options
]
LEVEL = {name: level for level, names in enumerate(LEVELS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layering unit of a module: `chatapp.engine.loop` -> `engine`, `chatapp.errors` -> `errors`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "chatapp"


def _eager(body: list[ast.stmt]):
    """The statements that run when the module is imported: not in functions, not under `if TYPE_CHECKING`."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _eager(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _eager([n for n in getattr(node, field, []) if isinstance(n, ast.stmt)])
        for handler in getattr(node, "handlers", []):
            yield from _eager(handler.body)


def _imports(*, eager_only: bool = False) -> dict[str, set[str]]:
    """Module -> the chatapp modules it imports (with `eager_only`, only the imports that run at import time)."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _eager(tree.body) if eager_only else ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                names = [base]
                names += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            else:
                continue
            edges[module].update(name for name in names if name in modules and name != module)
    return edges


def test_every_unit_has_a_level() -> None:
    units = {_unit(module) for module in _imports()} | {_unit(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert units - {"chatapp", "__main__"} <= set(LEVEL), f"add to LEVELS: {units - set(LEVEL) - {'chatapp'}}"


def test_no_import_runs_up_or_across_the_layers() -> None:
    wrong = []
    for module, targets in _imports().items():
        source = _unit(module)
        if source not in LEVEL:
            continue  # the package root (`chatapp/__init__.py`) and the entry point
        for target in targets:
            unit = _unit(target)
            if unit == source or unit == "chatapp":
                continue
            if LEVEL[unit] >= LEVEL[source]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports running up or across the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_between_modules() -> None:
    edges = _imports(eager_only=True)
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[list[str]] = []

    def visit(start: str) -> None:
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                cycles.append([*path[path.index(child) :], child])
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges.get(child, ())))))

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# What only building a model needs: an optimiser, a backward pass, process groups. The runtime's units (every level
# below `training`) serve models and never train one, so the trainers cannot drift back into them.
BUILD_ONLY = ("torch.optim", "torch.distributed", "torch.nn.parallel", ".backward(")


def test_training_code_lives_on_the_build_side() -> None:
    runtime = {name for name, level in LEVEL.items() if level < LEVEL["training"]}
    found = []
    for path in ROOT.rglob("*.py"):
        if _unit(_module_name(path)) not in runtime:
            continue
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(ROOT)}: {marker}" for marker in BUILD_ONLY if marker in text]
    assert not found, "build-time code in the runtime packages (move it to chatapp/training):\n" + "\n".join(found)


def test_no_runtime_or_command_module_imports_a_recipe_when_it_is_imported() -> None:
    """A recipe is how a shipped model was made: outside `chatapp/recipes` it is imported only inside the function
    that needs it (`chatapp eval`'s held-out set), never when a module loads."""
    eager = _imports(eager_only=True)
    found = [
        f"{module} -> {target}"
        for module, targets in eager.items()
        if _unit(module) != "recipes"
        for target in targets
        if _unit(target) == "recipes"
    ]
    assert not found, "module-level imports of a recipe:\n" + "\n".join(sorted(found))


def test_the_route_command_never_imports_a_recipe() -> None:
    """`chatapp route` reads its prompts as data (the set a model ships, or the user's file): nothing it imports,
    directly or through other modules, deferred or not, is a recipe."""
    edges = _imports()
    seen, todo = set(), ["chatapp.cli.route"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges.get(module, ()))
    assert "chatapp.training.route" in seen  # the walk follows the command's deferred imports
    assert not [m for m in seen if _unit(m) == "recipes"], sorted(m for m in seen if _unit(m) == "recipes")
