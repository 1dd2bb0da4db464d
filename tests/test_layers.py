"""The package's layers run one way, its modules stay small, and ``import hf_elixir`` stays light.

An ``ast`` scan of every module under ``hf_elixir/``: each import of another hf_elixir module,
at module level or inside a function, must point to the same layer or one below it (the order
is docs/design.md's), no module-level imports may form a cycle, and no hf_elixir import may
hide inside a function except the few that would otherwise pull in accelerate or
transformers. A failure names the module, the line and the arrow that runs the wrong way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_elixir"
#: bottom to top; a module may import its own layer and those before it
LAYERS = ["vocab", "optimizers", "profile", "hardware", "planner", "runtime", "measure", "checkpoint", "integrations", "cli"]
#: imports that stay inside functions because the module they load imports accelerate or
#: transformers at its top (the lazy public face, the launcher's bootstrap)
DEFERRED_ALLOWED = {
    ("hf_elixir", "hf_elixir.integrations"),
    ("hf_elixir.integrations.bootstrap", "hf_elixir.integrations.accelerate"),
    ("hf_elixir.integrations.bootstrap", "hf_elixir.integrations.trainer"),
}
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    """The layer index of a module; the package's own ``__init__`` (its public face) is above all."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)
    return LAYERS.index(parts[1])


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported hf_elixir module, line, inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    in_function = {id(sub) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for sub in ast.walk(node)}
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("hf_elixir"):
                continue
            # ``from hf_elixir.x import y`` may name a submodule y
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (PACKAGE.parent / sub.replace(".", "/")).is_dir() else base
                out.append((target, node.lineno, id(node) in in_function))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in in_function) for a in node.names if a.name.startswith("hf_elixir")]
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_layer() -> None:
    top = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in MODULES} - {"__init__"}
    assert top <= set(LAYERS), f"not in any layer: {sorted(top - set(LAYERS))}; add it to LAYERS and docs/design.md"


def test_imports_run_down_the_layers() -> None:
    wrong = []
    for path in MODULES:
        src = module_name(path)
        for target, line, _ in imports(path):
            if layer(target) > layer(src):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} ({LAYERS[layer(src)] if layer(src) < len(LAYERS) else 'package'}) "
                             f"imports {target} ({LAYERS[layer(target)] if layer(target) < len(LAYERS) else 'package'}), a layer above it")
    assert not wrong, "\n".join(wrong)


def test_no_hf_elixir_import_hides_in_a_function() -> None:
    hidden = [f"{path.relative_to(PACKAGE.parent)}:{line}: {target}"
              for path in MODULES for target, line, deferred in imports(path)
              if deferred and (module_name(path), target) not in DEFERRED_ALLOWED]
    assert not hidden, "imports inside functions (move them to the top of the module):\n" + "\n".join(hidden)


def test_module_level_imports_form_no_cycle() -> None:
    graph = {module_name(p): {t for t, _, deferred in imports(p) if not deferred} for p in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == node:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            # a package importing its own submodules is how packages export; a submodule
            # importing its package back is the cycle to refuse
            assert cycle is None or all(a.startswith(b + ".") for a, b in zip(cycle, cycle[1:])), " -> ".join(cycle)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_over_600_lines(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {n} lines; split it by concern"


def test_importing_the_package_imports_neither_accelerate_nor_transformers() -> None:
    """The integration classes are exported, and loaded (with accelerate) on first use."""
    code = ("import sys, hf_elixir as hfe\n"
            "assert 'accelerate' not in sys.modules and 'transformers' not in sys.modules, 'imported too early'\n"
            "names = ('ElixirAccelerator', 'ElixirTrainer', 'ElixirTrainingArguments', 'ElixirPlugin')\n"
            "assert all(n in hfe.__all__ for n in names)\n"
            "assert hfe.ElixirPlugin.__name__ == 'ElixirPlugin'\n"
            "assert hfe.ElixirAccelerator.__name__ == 'ElixirAccelerator' and 'accelerate' in sys.modules\n"
            "assert hfe.ElixirTrainer.__name__ == 'ElixirTrainer' and hfe.ElixirTrainingArguments\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_checkpoints_read_the_runtime_through_its_seam() -> None:
    """``checkpoint/`` reads no private attribute of anything, and of the runtime's objects
    (``emodel``, ``eoptimizer``) only their public face; chunks, slots, shards and the
    optimizer's bookkeeping are reached through ``hf_elixir.runtime.state`` alone."""
    public = {"comm", "plan", "algorithm", "param_groups", "scaler", "zero_grad"}
    found = []
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else ""
            private = node.attr.startswith("_") and not node.attr.startswith("__") and owner != "self"
            if private or (owner in ("emodel", "eoptimizer") and node.attr not in public):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {owner}.{node.attr}")
    assert not found, "checkpoint/ reaches into the runtime:\n" + "\n".join(found)
