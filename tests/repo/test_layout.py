"""The package's layout rules: no import cycle between its modules, no module a reader
cannot hold in one sitting, no torch module named that mypy is told not to follow."""

import ast
import tomllib
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


def _dotted(node: ast.AST) -> str | None:
    """``torch.fx.GraphModule`` for that attribute chain; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(names)])


def test_mypy_skips_no_torch_module_the_package_names():
    """pyproject.toml's mypy section does not follow some torch packages (its time); a name
    the package takes from one would be Any to mypy, unchecked. So none is named."""
    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["mypy"]
    skipped = [
        pattern.removesuffix(".*")
        for override in config["overrides"]
        if override.get("follow_imports") == "skip"
        for pattern in override["module"]
        if pattern.startswith("torch.")
    ]
    assert "torch.fx" in skipped, skipped
    checked = [PACKAGE.parent / f for f in config["files"]]
    files = [p for f in checked for p in ([f] if f.is_file() else sorted(f.rglob("*.py")))]
    assert len(files) > 50 and all(p.suffix == ".py" for p in files)
    named: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found = [node.module]
            else:
                found = [d] if (d := _dotted(node)) else []
            for name in found:
                if any(name == s or name.startswith(s + ".") for s in skipped):
                    named.setdefault(str(path.relative_to(PACKAGE.parent)), set()).add(name)
    assert not named, (
        f"names a torch module that pyproject.toml's mypy section does not follow: {named}; "
        "take that module out of the override's list so mypy checks the use"
    )
