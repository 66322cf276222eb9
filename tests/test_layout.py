"""The package map stays one-way: no import cycle between modules, a small ``rltpu/`` top level.

Imports are read from the source (``ast``), lazy ones inside functions included, so a cycle that
only bites at run time (``a`` imports ``b`` in a function, ``b`` imports ``a`` at the top) is
caught here rather than by whichever test happens to import ``b`` first.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rltpu", "actors", "learner")
# the one edge against the package order: the config schema fills a model section from a checkpoint's
# config.json through ``rltpu.models.hf.config``, a module that imports nothing of rltpu (checked below)
SCHEMA_READS_CHECKPOINTS = ("rltpu.config", "rltpu.models")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours that ``name`` imports anywhere in its body (top level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if is_pkg else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _unit(module: str) -> str:
    """The package a module belongs to: ``rltpu.<sub>`` (or a top-level module), ``actors``, ``learner``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rltpu" else parts[0]


def test_the_cycle_finder_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from rltpu.config import RunConfig\n    import learner.losses\n")
    known = {"rltpu.config": src, "learner.losses": src, "m": src}
    assert _imports("m", src, known) == {"rltpu.config", "learner.losses"}


def test_no_import_cycle_between_modules():
    graph = _graph()
    assert len(graph) > 50  # the walk really found the tree
    assert "actors.sampler_actor" in graph["rltpu.control.modes"]  # a lazy import, found
    assert _cycles(graph) == []


def test_packages_import_one_way():
    """Between packages (``rltpu.chips``, ``rltpu.sync``, ..., ``actors``, ``learner``) the imports
    form a DAG, apart from the schema reading a checkpoint's config.json."""
    graph: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        for dep in deps:
            if _unit(dep) != _unit(mod) and (_unit(mod), _unit(dep)) != SCHEMA_READS_CHECKPOINTS:
                graph.setdefault(_unit(mod), set()).add(_unit(dep))
                graph.setdefault(_unit(dep), set())
    assert _cycles(graph) == []
    assert _graph()["rltpu.models.hf.config"] == set()  # why the exception above cannot close a cycle


def test_package_inits_hold_no_code():
    """An ``__init__`` runs whenever any module under it is imported: docstrings only, so importing
    ``rltpu.plan.shapes`` does not drag in the planner, and the module graph above is the whole story."""
    for path in [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")]:
        body = ast.parse(path.read_text()).body
        assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body), path


def test_rltpu_top_level_is_small():
    entries = [p.name for p in (ROOT / "rltpu").iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())]
    assert len(entries) <= 10, sorted(entries)
