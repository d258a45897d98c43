"""The package's layout rules: no import cycle between its modules, no module a reader
cannot hold in one sitting."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_retain"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Package modules ``path`` imports at run time (``TYPE_CHECKING`` blocks left out)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.level:
                base = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                target = f"{base}.{child.module}" if child.module else base
                if child.module:
                    found.add(target)
                else:
                    found.update(f"{target}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("fsdp_retain"))
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_no_import_cycle():
    graph = _graph()
    assert "fsdp_retain._lifecycle" in graph and graph["fsdp_retain._fsdp1._block"]
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def walk(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                walk(dep, stack + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])


def test_modules_fit_one_sitting():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split by concern): {long}"
