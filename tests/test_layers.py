"""The package's imports follow docs/DESIGN.md's data flow: no circles, no stage importing a later
one, the engine never importing the tools or the CLI.

Every ``import`` and ``from ... import`` counts, at module level or deferred inside a
function (a deferred import that dodges a circle is still a circle).
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where each module's source lives: the engine, the built-in backends included.
SOURCES = {"collage_tvm": ROOT / "collage_tvm"}

# docs/DESIGN.md's data flow, earliest first. A module may import its own stage or earlier ones.
STAGES = [
    # foundation: file and memory helpers, targets, precisions, the backend registry and its lowering interface,
    # the search options, the Relax -> ONNX writer (graph libraries' patterns and lowerings),
    # torchvision's import against a CPU torch (the suites; onnx2torch in the inductor backend)
    ["collage_tvm._version", "collage_tvm._files", "collage_tvm._errors", "collage_tvm._memory", "collage_tvm.target", "collage_tvm.precision",
     "collage_tvm.registry", "collage_tvm.lowering", "collage_tvm._torchvision",
     "collage_tvm.options", "collage_tvm.export", "collage_tvm.dynamic",
     "collage_tvm.dynamic.shapes"],
    ["collage_tvm.frontend"],
    ["collage_tvm.rewrite"],
    ["collage_tvm.graph"],
    ["collage_tvm.tuning"],  # TVM's kernels, the tuning database, MetaSchedule in process
    ["collage_tvm.placement"],
    ["collage_tvm.patterns"],  # the kit pattern files are written with
    ["collage_tvm.candidates"],  # the generator: pattern files -> candidates over a graph
    ["collage_tvm.backends"],  # the built-in lowerings and pattern files (one folder each)
    ["collage_tvm.measure", "collage_tvm.placement_log"],
    ["collage_tvm.placer"],
    ["collage_tvm.schedule"],  # IOS's stages over a placement (issue #80)
    ["collage_tvm.byoc.partition"],  # chosen groups become functions (BYOC partitioning)
    ["collage_tvm.byoc"],  # external groups lowered to callables, the placement compiled
    # a schedule's concurrent stages built as calls, and the schedule measured (issue #80)
    ["collage_tvm.schedule.concurrent", "collage_tvm.schedule.plan"],
    # the first calls racing what the search left close; the side-by-side timing it reuses
    ["collage_tvm.check.fastest", "collage_tvm.check.race"],
    ["collage_tvm.dynamic.dispatch"],  # a dynamic model's build: a call to each shape's build
    ["collage_tvm.check"],
    ["collage_tvm.artifact"],  # a build saved, and loaded without the search
    ["collage_tvm.dynamic.search"],  # the search over a range of shapes
    ["collage_tvm.report", "collage_tvm.stores"],  # what a build found; where it keeps it
    ["collage_tvm.placing"],  # a new placement: op level, graph level, final check
    ["collage_tvm.stages"],  # the search, stage by stage
    ["collage_tvm.build", "collage_tvm.pipeline", "collage_tvm.tuning.plan", "collage_tvm",
     "collage_tvm.torch_backend"],
    # on top: never imported by the engine
    ["collage_tvm.cli", "collage_tvm.tools"],
]
TOOLS = ("collage_tvm.cli", "collage_tvm.tools")


def modules(sources: dict) -> dict:
    """module name -> (file, is_package) of every .py file under ``sources``."""
    out = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join([package, *parts])] = (path, is_package)
    return out


def imports(name: str, path: Path, is_package: bool, known: dict) -> list:
    """[(imported module, line)] of one module, restricted to ``known`` modules."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if is_package else name.rpartition(".")[0]
    found = []

    def add(target: str, line: int) -> None:
        while target and target not in known:  # "a.b.func" -> "a.b"
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append((target, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # "from pkg import submodule" imports the submodule
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base,
                    node.lineno)
    return found


def stage_of(name: str, stages: list) -> int:
    best, rank = -1, None
    for k, prefixes in enumerate(stages):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), k
    return rank


def violations(sources: dict, stages: list, tools: tuple) -> list:
    """Messages for every import circle, backward import and engine-imports-tool."""
    known = modules(sources)
    graph = {name: imports(name, path, pkg, known) for name, (path, pkg) in known.items()}
    out = []
    for name, edges in graph.items():
        here = stage_of(name, stages)
        if here is None:
            out.append(f"{name}: in no stage of the data flow (add it to STAGES)")
            continue
        for target, line in edges:
            there = stage_of(target, stages)
            where = f"{os.path.relpath(known[name][0], ROOT)}:{line}"
            if there is not None and there > here:
                out.append(f"{where}: {name} (stage {here}) imports {target}, a later stage "
                           f"({there})")
            if any(target.startswith(t) for t in tools) and \
                    not any(name.startswith(t) for t in tools):
                out.append(f"{where}: the engine module {name} imports the tool {target}")
    out += [f"import circle: {' -> '.join(c + [c[0]])}" for c in circles(graph)]
    return out


def circles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_imports_follow_the_data_flow_without_circles():
    found = violations(SOURCES, STAGES, TOOLS)
    assert not found, "\n".join(found)


def test_the_layer_check_catches_a_circle_a_backward_import_and_a_tool_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "early").mkdir(parents=True)
    (pkg / "tools").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "early" / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "early" / "a.py").write_text("def f():\n    from ..late import g\n")  # deferred
    (pkg / "late.py").write_text("from .early import a\nfrom pkg.tools import x\n")
    (pkg / "tools" / "x.py").write_text("import pkg.late\n")
    found = violations({"pkg": pkg}, [["pkg.early"], ["pkg.late", "pkg"], ["pkg.tools"]],
                       ("pkg.tools",))
    text = "\n".join(found)
    assert "pkg.early.a (stage 0) imports pkg.late, a later stage (1)" in text
    assert "the engine module pkg.late imports the tool pkg.tools" in text
    assert "import circle: pkg.early.a -> pkg.late" in text
    assert "import circle" in text and "pkg.tools.x" in text  # late -> tools.x -> late
