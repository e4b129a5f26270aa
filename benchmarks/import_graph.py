"""The import graph of ``fair_frontend``: which module imports which, read with ``ast``.

Every ``import``/``from ... import`` in every module of the package counts, wherever it
is: at the top, inside a function (a hidden import) or under ``if TYPE_CHECKING:`` (for
typing only). Printed:

- package-level edges (a package is ``fair_frontend``'s first level: ``scheduler``,
  ``core``, ... or a top-level module such as ``config``), with how many imports each;
- circles: strongly connected components of more than one module, over all imports and
  over the imports that run (TYPE_CHECKING left out), and the same between packages;
- imports hidden in functions;
- imports from the policy packages (``scheduler``, ``admission``, ``feedback``) of
  ``config``.

Importing ``a.b.c`` also runs ``a/b/__init__.py``; that implicit edge is not counted, only
the module named.

    .venv/bin/python -m benchmarks.import_graph [--root DIR] [--json PATH]

``--root`` is the directory that holds ``fair_frontend/`` (default: this checkout), so
another commit can be read from an export of it (``git archive main | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = "fair_frontend"
POLICY = ("scheduler", "admission", "feedback")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    where: str  # "top", "function" or "type_checking"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str]) -> None:
        self.module = module
        self.is_package = is_package
        self.modules = modules
        self.edges: list[Edge] = []
        self._function = 0
        self._type_checking = 0

    def _where(self) -> str:
        if self._function:
            return "function"
        if self._type_checking:
            return "type_checking"
        return "top"

    def _add(self, target: str, line: int) -> None:
        # The longest known module that the name starts with (``fair_frontend.x.Y`` → ``x``).
        while target and target not in self.modules:
            target = target.rpartition(".")[0]
        edge = Edge(self.module, target, line, self._where())
        if target and target != self.module and edge not in self.edges:
            self.edges.append(edge)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_checking += 1
            for child in node.body:
                self.visit(child)
            self._type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            if not self.is_package:
                base.pop()
            base = base[: len(base) - (node.level - 1)]
            stem = ".".join([*base, node.module] if node.module else base)
        else:
            stem = node.module or ""
        if stem.split(".")[0] != PACKAGE:
            return
        for alias in node.names:
            candidate = f"{stem}.{alias.name}"
            self._add(candidate if candidate in self.modules else stem, node.lineno)


def read_graph(root: Path) -> tuple[list[str], list[Edge]]:
    paths = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(root, p): p for p in paths}
    edges: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        visitor = _Imports(name, path.name == "__init__.py", set(modules))
        visitor.visit(tree)
        edges.extend(visitor.edges)
    return sorted(modules), edges


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def components(nodes: list[str], pairs: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    successors: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in sorted(pairs):
        successors[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for j in range(i, len(successors[node])):
                nxt = successors[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                scc = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    scc.append(top)
                    if top == node:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def analyse(root: Path) -> dict:
    modules, edges = read_graph(root)
    packages = sorted({package_of(m) for m in modules})
    all_pairs = {(e.source, e.target) for e in edges}
    run_pairs = {(e.source, e.target) for e in edges if e.where != "type_checking"}
    package_edges = Counter(
        (package_of(e.source), package_of(e.target))
        for e in edges
        if package_of(e.source) != package_of(e.target)
    )
    package_pairs = set(package_edges)
    package_run_pairs = {
        (package_of(e.source), package_of(e.target))
        for e in edges
        if e.where != "type_checking" and package_of(e.source) != package_of(e.target)
    }
    return {
        "modules": len(modules),
        "imports": len(edges),
        "package_edges": [
            {"source": a, "target": b, "imports": n} for (a, b), n in sorted(package_edges.items())
        ],
        "module_circles": [[short(m) for m in c] for c in components(modules, all_pairs)],
        "module_circles_at_run_time": [
            [short(m) for m in c] for c in components(modules, run_pairs)
        ],
        "package_circles": components(packages, package_pairs),
        "package_circles_at_run_time": components(packages, package_run_pairs),
        "type_checking_imports": [
            asdict(e) | {"source": short(e.source), "target": short(e.target)}
            for e in edges
            if e.where == "type_checking"
        ],
        "hidden_imports": [
            asdict(e) | {"source": short(e.source), "target": short(e.target)}
            for e in edges
            if e.where == "function"
        ],
        "policy_to_config": [
            asdict(e) | {"source": short(e.source), "target": short(e.target)}
            for e in edges
            if package_of(e.source) in POLICY and package_of(e.target) == "config"
        ],
    }


def report(result: dict) -> str:
    out = [
        f"{result['modules']} modules, {result['imports']} internal imports (statement, module)",
        "",
    ]
    out.append("package edges (imports):")
    by_source: dict[str, list[str]] = {}
    for e in result["package_edges"]:
        by_source.setdefault(e["source"], []).append(f"{e['target']}({e['imports']})")
    out += [f"  {s} -> {', '.join(ts)}" for s, ts in sorted(by_source.items())]

    def circles(title: str, found: list[list[str]]) -> None:
        out.append("")
        out.append(f"{title}: {len(found) or 'none'}")
        out.extend(f"  {' <-> '.join(c)}" for c in found)

    circles("module circles (all imports)", result["module_circles"])
    circles("module circles (at run time)", result["module_circles_at_run_time"])
    circles("package circles (all imports)", result["package_circles"])
    circles("package circles (at run time)", result["package_circles_at_run_time"])

    def listing(title: str, edges: list[dict]) -> None:
        out.append("")
        out.append(f"{title}: {len(edges) or 'none'}")
        out.extend(f"  {e['source']}:{e['line']} -> {e['target']}" for e in edges)

    listing("imports under TYPE_CHECKING", result["type_checking_imports"])
    listing("imports hidden in functions", result["hidden_imports"])
    listing("policy packages -> config", result["policy_to_config"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="directory holding fair_frontend/ (default: this checkout)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if not (args.root / PACKAGE).is_dir():
        parser.error(f"no {PACKAGE}/ under {args.root}")
    result = analyse(args.root)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
