"""The package's layers (pyproject.toml's import-linter contracts) hold, and no module imports itself through others:
function-level imports included. docs/ARCHITECTURE.md draws them."""
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=cwd, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)},
                          capture_output=True, text=True, timeout=300)


def test_the_layers_and_contracts_hold():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


def test_an_import_up_the_layers_breaks_the_contracts(tmp_path):
    """The contracts fail on a model that imports the run, inside a function as at the top."""
    shutil.copytree(ROOT / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    model = tmp_path / "harness" / "models" / "pipeline.py"
    model.write_text(model.read_text() + "\n\ndef _sneak():\n    from ..run import loop  # noqa: F401\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout
    assert "models import nothing distributed BROKEN" in done.stdout
    assert "harness.models.pipeline -> harness.run.loop" in done.stdout


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("harness", include_external_packages=False, cache_dir=None)
    assert len(graph.modules) > 60
    assert cycles(graph) == []
    graph.add_import(importer="harness.config.run", imported="harness.tasks.registry")  # the cycle there was
    assert cycles(graph) == [["harness.config.run", "harness.data.rows", "harness.tasks.interface",
                              "harness.tasks.registry"]]


MAX_FUNCTION_LINES = 80  # a function a reader can hold in their head (docs/ARCHITECTURE.md)


def long_functions(root: Path) -> list[str]:
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_package_is_over_80_lines(tmp_path):
    assert long_functions(ROOT / "harness") == []
    # the check can fail: a function of 81 lines is named
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "long.py").write_text("def f():\n" + "    x = 1\n" * 80)
    assert long_functions(tmp_path / "harness") == ["harness/long.py:1 f (81 lines)"]
