"""The house rules of the package, checked on its source (no imports executed): imports run one way through the
layers, no import circles, no module over 400 lines, imports inside functions only with a one-line reason,
and a docstring on every public name. See "Contributing" in the README for the layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flatlm"
MAX_LINES = 400

# Lower layers never import higher ones. Modules of one layer may import each other (without circles).
LAYERS = [
    ("flatlm", "flatlm.allocator", "flatlm.cpu_codegen", "flatlm.compile_options", "flatlm.errors", "flatlm.paths",
     "flatlm.config", "flatlm.table", "flatlm.results", "flatlm.metrics", "flatlm.sharding",
     "flatlm.checkpoint"),  # foundation: no model, no language
    ("flatlm.languages",),
    ("flatlm.data",),
    ("flatlm.models",),
    ("flatlm.run",),  # open a workdir: config, language, data, model, parameters (no optimizer)
    ("flatlm.evaluate",),  # evaluators of (apply_fn, params): exact loss, probe, fine-tuning
    ("flatlm.train", "flatlm.flatness"),
    ("flatlm.experiment", "flatlm.report", "flatlm.report_plots", "flatlm.report_stacking", "flatlm.report_paired",
     "flatlm.report_curvature",
     "flatlm.demo",
     "flatlm.theory", "flatlm.claims", "flatlm.reproduce", "flatlm.reproduce_paper",
     "flatlm.reproduce_points", "flatlm.reproduce_report", "flatlm.reproduce_run"),
    ("flatlm.cli",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def layer(module: str) -> int:
    """Index of the layer whose longest prefix matches `module`."""
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best_len:
                best, best_len = i, len(n)
    assert best is not None, f"{module} is in no layer; add it to LAYERS"
    return best


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path):
    """(imported flatlm module, line, inside a function?, the source line and the one above) for each import."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            in_function.update(id(sub) for sub in ast.walk(node) if sub is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                names = [".".join(base + ([node.module] if node.module else []) + [a.name]) for a in node.names]
            else:
                names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        context = lines[node.lineno - 1] + "\n" + (lines[node.lineno - 2] if node.lineno > 1 else "")
        for n in names:
            yield n, node.lineno, id(node) in in_function, context


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for name, *_ in _imports(m, path):
            target = _resolve(name) if name.startswith("flatlm") else None
            if target and target != m and not m.startswith(target + "."):  # a package's own __init__ is not a use
                graph[m].add(target)
    return graph


def test_imports_run_downward_through_the_layers():
    upward = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
              for m, targets in _graph().items() for t in targets if layer(t) > layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph, state, circles = _graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


def test_imports_inside_functions_say_why():
    """Only optional extras or start-up time justify an import inside a function, with a `#` comment saying so."""
    silent = [f"{path.relative_to(PACKAGE.parent)}:{line}" for m, path in MODULES.items()
              for _, line, inside, context in _imports(m, path) if inside and "#" not in context]
    assert not silent, "\n".join(sorted(set(silent)))


def test_no_module_over_400_lines():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def _public_defs(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


@pytest.mark.parametrize("module", sorted(MODULES))
def test_public_names_have_docstrings(module):
    tree = ast.parse(MODULES[module].read_text())
    assert ast.get_docstring(tree), f"{module} has no module docstring"
    missing = [name for name, node in _public_defs(tree)
               if not ast.get_docstring(node) and not name.endswith(".setup")]  # Flax's own hook
    assert not missing, f"{module}: {missing}"


def test_one_shape_suffix_convention():
    """Shape suffixes are unseparated capitals (`tokens_BT`), never the `x`-separated form (`tokens_BxT`)."""
    pattern = re.compile(r"\b[a-z][a-z0-9_]*_[A-Z](?:x[A-Z])+\b")
    found = [f"{p.relative_to(PACKAGE.parent)}: {m}" for p in MODULES.values()
             for m in sorted(set(pattern.findall(p.read_text())))]
    assert not found, "\n".join(found)


def test_every_benchmark_script_compiles():
    """`make bench` runs every script in benchmarks/, on a machine with the `bench` extra, and CI runs none of them:
    a script that does not even compile (gpu.py read a name before its `global` declaration for four days) is
    caught here. compile() runs the symbol-table pass that raises it, without importing the peers."""
    scripts = sorted((PACKAGE.parent / "benchmarks").glob("*.py"))
    assert len(scripts) >= 10, scripts
    for path in scripts:
        compile(path.read_text(), str(path), "exec")
