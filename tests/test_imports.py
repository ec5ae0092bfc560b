"""The project's modules import one another without a circle.

Every import statement of every .py file under pretrain/, eval/, transfer/ and launch/ is read with `ast` (at
module level and inside functions and classes alike: an import deferred into a function is still a dependency),
never executed, so this test is fast and imports neither torch nor the project. An import of a project module
is an edge of the graph:

- `import a.b.c` imports the module `a.b.c`;
- `from a.b import name` imports `a.b.name` when that is a module (a file or a package), else `a.b`;
- relative imports (`from . import x`, `from ..y import z`) are resolved against the importing module;
- a package's `__init__.py` is the module of the package itself (`pretrain/methods/__init__.py` is
  `pretrain.methods`);
- a name that is not a module of the project resolves to its longest prefix that is (`import a.b.attr` -> `a.b`);
  imports of other packages (torch, detectron2, ...) are not edges.

A circle (a strongly connected component of more than one module) fails the test, which prints one circle as
`a -> b -> a` for every such component. So does an import from the training runtime (`pretrain/runtime/`, what
pretraining, fine-tuning and detection all train through) into any other project module: the runtime depends on
no stage, and on nothing of the pretraining feature (methods, losses, data, models, its config).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pretrain", "eval", "transfer", "launch")
RUNTIME = "pretrain.runtime"


def module_name(path: str) -> str:
    """`pretrain/methods/base.py` -> `pretrain.methods.base`; `pretrain/methods/__init__.py` -> `pretrain.methods`."""
    parts = path[:-len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_sources(root: Path = ROOT) -> dict[str, str]:
    """Relative path (with /) -> source text of every .py file under the project's packages."""
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
            for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def imported_names(source: str, module: str, is_package: bool) -> list[str]:
    """The dotted names every import statement of `source` (the code of `module`) may import, before they are
    matched to project modules: `import a.b` -> a.b; `from a import n` -> a.n and a (see `import_graph`)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:          # relative: from the package of `module` (itself, when it is a package)
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names += [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
    return names


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its code), from {relative path: source}."""
    modules = {module_name(path): path for path in sources}
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for path, source in sources.items():
        module = module_name(path)
        for name in imported_names(source, module, path.endswith("__init__.py")):
            while name and name not in modules:      # `from pkg import name`: pkg.name if a module, else pkg
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                        components.append(sorted(component))
    return components


def cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the modules of `component`, as [a, b, ..., a] (a shortest one from its first module)."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:                                   # breadth first: the shortest way back to `start`
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    return paths[node] + [start]
                if successor not in paths:
                    paths[successor] = paths[node] + [successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def import_cycles(sources: dict[str, str]) -> list[str]:
    """`a -> b -> a` for one circle of every strongly connected component of the import graph."""
    graph = import_graph(sources)
    return [" -> ".join(cycle_in(graph, component)) for component in strongly_connected_components(graph)]


def in_runtime(module: str) -> bool:
    return module == RUNTIME or module.startswith(RUNTIME + ".")


def imports_out_of_the_runtime(sources: dict[str, str]) -> list[str]:
    """`a -> b` for every import of a project module `b` outside the runtime by a module `a` of the runtime."""
    graph = import_graph(sources)
    return [f"{module} -> {imported}" for module in sorted(graph) if in_runtime(module)
            for imported in sorted(graph[module]) if not in_runtime(imported)]


def test_project_modules_import_one_another_without_a_circle():
    sources = project_sources()
    assert {"pretrain/config.py", "eval/__main__.py", "transfer/__main__.py", "launch/__main__.py"} <= set(sources)
    cycles = import_cycles(sources)
    assert not cycles, "import circles among the project's modules:\n  " + "\n  ".join(cycles)


def test_the_scan_sees_imports_inside_functions_and_from_package_imports():
    # a -> b at module level, b -> a inside a function through `from pkg import module`: a circle.
    sources = {"pretrain/__init__.py": "", "pretrain/a.py": "from pretrain.b import helper\n",
               "pretrain/b.py": "def helper():\n    from pretrain import a\n    return a\n",
               "pretrain/c.py": "from . import a\nimport pretrain.b.helper\nimport torch\n"}
    assert import_graph(sources) == {"pretrain": set(), "pretrain.a": {"pretrain.b"}, "pretrain.b": {"pretrain.a"},
                                     "pretrain.c": {"pretrain.a", "pretrain.b"}}
    assert import_cycles(sources) == ["pretrain.a -> pretrain.b -> pretrain.a"]
    # `from pkg import name` of a name defined in pkg/__init__.py is an import of pkg: no circle without b -> a.
    sources["pretrain/b.py"] = "def helper():\n    from pretrain import something\n"
    sources["pretrain/__init__.py"] = "something = 1\n"
    assert import_graph(sources)["pretrain.b"] == {"pretrain"} and import_cycles(sources) == []


def test_the_training_runtime_imports_nothing_outside_it():
    sources = project_sources()
    assert {"pretrain/runtime/loop.py", "pretrain/runtime/checkpoint.py", "pretrain/runtime/config.py"} <= set(sources)
    outside = imports_out_of_the_runtime(sources)
    assert not outside, ("the training runtime (pretrain/runtime/) imports modules outside it; move what it needs "
                         "into it, or let the stage pass it in:\n  " + "\n  ".join(outside))


def test_the_runtime_scan_sees_an_import_of_the_feature_inside_a_function():
    sources = {"pretrain/__init__.py": "", "pretrain/runtime/__init__.py": "", "pretrain/data.py": "",
               "pretrain/runtime/loop.py": "from pretrain.runtime import task\n"
                                           "def build():\n    from pretrain.data import DatasetError\n",
               "pretrain/runtime/task.py": "import torch\n",
               "pretrain/export.py": "from pretrain.runtime import task\n"}      # the feature may import the runtime
    assert imports_out_of_the_runtime(sources) == ["pretrain.runtime.loop -> pretrain.data"]
