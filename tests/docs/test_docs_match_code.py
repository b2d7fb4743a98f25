"""The documents a newcomer reads name what the code has: error codes, Stats fields, the
architecture's modules."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

from disagg.protocol import ErrorCode, FinishReason, Stats

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
ARCH = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_the_readme_lists_every_error_code_and_finish_reason():
    section = README[README.index("Error codes:"):README.index("A bad\nmessage never stops")]
    listed = set(re.findall(r"`([a-z_]+)`", section))
    assert set(get_args(ErrorCode)) <= listed
    for reason in get_args(FinishReason):
        assert f"`{reason}`" in README


def test_the_readme_lists_every_stats_field():
    row = [line for line in README.splitlines() if line.startswith("| `stats` |")][-1]
    listed = set(re.findall(r"`([a-z_]+)`", row)) - {"stats"}
    assert listed == set(Stats.__struct_fields__) - {"v"}


def test_every_module_the_architecture_names_exists():
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.glob("**/*.py")
             if ".venv" not in p.parts]
    for path in set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", ARCH)):
        assert any(f == path or f.endswith("/" + path) for f in files), path


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at module level or inside functions, but not those
    under ``if TYPE_CHECKING:`` (they never run)."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _module_imports() -> dict[str, set[str]]:
    """disagg module -> the disagg modules it imports, at module level or inside functions (a
    function-level import is a cycle put off, not removed); not under TYPE_CHECKING."""
    root = ROOT / "disagg"
    names = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for mod, path in names.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            deps |= {t for t in targets if t in names and t != mod}
        graph[mod] = deps
    return graph


def test_function_level_and_type_checking_imports_are_told_apart():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
                     "def f():\n    from d import e\n")
    assert sorted(ast.unparse(n) for n in _imports(tree)) == [
        "from d import e", "import a", "import c"]


def test_no_import_cycles_between_modules():
    graph = _module_imports()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if d.startswith(m + "."):
                continue  # a package's __init__ importing its own submodule
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                if not all(a.startswith(b + ".") or b.startswith(a + ".")
                           for a, b in zip(cycle, cycle[1:], strict=False)):
                    raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_module_is_over_about_450_lines():
    """Modules are split along their seams before they grow much past ~450 lines."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "disagg").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 490}
    assert not long, long


def _definitions() -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(every name disagg defines, class -> the names its body and methods set, module paths)."""
    import ast

    names: set[str] = set()
    members: dict[str, set[str]] = {}
    modules: set[str] = set()
    for path in (ROOT / "disagg").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules |= {".".join(parts[i:]) for i in range(len(parts))} - {"__init__"}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                own = members.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(sub.name)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        own.add(sub.attr)
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        own.add(sub.id)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names, members, modules


OUTSIDE = {"LogitsProcessor"}  # transformers' names the document points at


def test_every_class_and_member_the_architecture_names_exists():
    """Each `Name` (a class) and `Name.member` in ARCHITECTURE.md is defined in disagg, the
    member in that class; a dotted module prefix (`remote.decode.DecodeRemote`) must be a
    module. So a rename that forgets the document fails here."""
    names, members, modules = _definitions()
    bad = []
    for token in set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)`", ARCH)):
        parts = token.split(".")
        if parts[-1] in {"py", "json", "toml", "md"} or token in OUTSIDE:
            continue
        if not (parts[0][:1].isupper() or len(parts) > 1):
            continue  # a lowercase word: a value, a flag's argument, a field
        lead = next((i for i in range(len(parts), 0, -1)
                     if ".".join(parts[:i]) in modules), 0)
        rest = parts[lead:]
        if not rest or rest[0] not in names:
            bad.append(token)
        elif len(rest) > 1 and rest[0] in members and rest[1] not in members[rest[0]]:
            bad.append(token)
    assert not bad, sorted(bad)
