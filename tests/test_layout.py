"""The source tree's shape (issue 27): imports between hybridlm's modules form no cycle, only the
entry point imports the CLI, no source file outgrows what a reader holds in their head, and the
engine and the prefix cache are rooms of a few methods each."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CLI = "hybridlm.cli"
ENTRY = {"hybridlm.cli", "hybridlm.__main__"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module under src/hybridlm."""
    found = {}
    for path in (SRC / "hybridlm").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the hybridlm modules it imports anywhere in its body (functions included, and
    `TYPE_CHECKING` blocks: a cycle there is still a tangle). `from pkg import name` counts as an
    import of the submodule `pkg.name` when there is one, else of `pkg`."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, package) in known.items():
        here = name if package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.startswith("hybridlm")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base.startswith("hybridlm"):
                    full = (f"{base}.{a.name}" for a in node.names)
                    targets |= {f if f in known else owner(base) for f in full}
        graph[name] = targets - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_imports_between_modules_form_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_entry_point_imports_the_cli():
    upward = sorted(name for name, targets in import_graph().items() if CLI in targets and name not in ENTRY)
    assert upward == []


MAX_LINES = 700
MAX_METHODS = 25


def test_no_source_file_outgrows_a_reader():
    long = {}
    for path in (SRC / "hybridlm").rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[str(path.relative_to(SRC))] = lines
    assert long == {}


def method_counts(trees: dict[str, ast.Module]) -> dict[str, int]:
    """"file:Class" -> the methods the class defines plus those it inherits from the classes in
    `trees` (a class assembled from mixins is as big as their sum); a base is looked up in its own
    file first, then by name elsewhere. trees: file path -> parsed source."""
    classes: dict[str, ast.ClassDef] = {}
    by_name: dict[str, list[str]] = {}
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                key = f"{where}:{node.name}"
                classes[key] = node
                by_name.setdefault(node.name, []).append(key)

    def count(key: str) -> int:
        node = classes[key]
        where = key.split(":")[0]
        total = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
        for base in node.bases:
            if isinstance(base, ast.Name):
                local = f"{where}:{base.id}"
                found = local if local in classes else next(iter(by_name.get(base.id, [])), None)
                total += count(found) if found else 0
        return total

    return {key: count(key) for key in classes}


def test_the_engine_and_prefix_cache_are_rooms_of_a_few_methods():
    trees = {
        str(path.relative_to(SRC / "hybridlm")): ast.parse(path.read_text())
        for path in (SRC / "hybridlm").rglob("*.py")
    }
    rooms = {key: n for key, n in method_counts(trees).items() if key.split("/")[0] in ("engine", "prefix")}
    assert "engine/engine.py:Engine" in rooms and "prefix/cache.py:PrefixCache" in rooms
    assert {key: n for key, n in rooms.items() if n > MAX_METHODS} == {}


def test_the_method_count_sees_through_mixins():
    mixin = lambda name: f"class {name}:\n" + "".join(f"    def {name}{i}(self): pass\n" for i in range(20))  # noqa: E731
    composed = mixin("B") + "class C(A, B):\n    pass\n"
    trees = {"engine/a.py": ast.parse(mixin("A")), "engine/b.py": ast.parse(composed)}
    assert method_counts(trees)["engine/b.py:C"] == 40
