"""Which ONNX operators TVM's ONNX importer writes as ``call_tir`` (issue #33).

The importer converts a few ordinary operators with ``bb.emit_te(topi.xxx, ...)``: what it
leaves is an ``R.call_tir`` of a PrimFunc, which no graph-library pattern or exporter case
takes, so such a node cuts every onnxruntime/openvino region around it. This script imports
the onnx wheel's node test suite and a few torchvision / transformers models, and records
for each ``call_tir`` left in ``main`` after ``normalize_for_collage``: the ONNX operator
that wrote it, the PrimFunc, and whether ``raise_call_tir`` turns it into a Relax op. For
the models it also counts the nodes no graph library can take, before and after raising.

    python -m collage_tvm.tools.call_tir_survey [--suite node|models|all] [--json FILE]

Prints the Markdown tables and writes the JSON (with the machine and library versions);
docs/COVERAGE.md renders its tables from the committed one
(docs/results/call_tir_survey.json, ``collage_tvm.tools.docs`` kind ``call-tir-survey``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import warnings

# What ``raise_call_tir`` makes of each PrimFunc the importer writes, and why not where not.
RAISED_TO = {
    "maximum": "R.maximum; R.clip with a following minimum",
    "minimum": "R.minimum; R.clip after a maximum",
    "pad": "R.nn.pad (constant)",
    "replicate_pad": "R.nn.pad (replicate)",
    "mirror_pad": "not raised: R.nn.pad reflect legalizes to another PrimFunc (reflect_pad)",
    "circular_pad": "not raised: ONNX Pad wrap needs opset 19 (no library gain)",
    "tile": "R.tile",
    "flip": "R.flip",
    "einsum": "not raised: the PrimFunc does not keep the equation",
    "dyn_tile": "not raised: output shape read from a tensor",
}

MODELS = ("mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "shufflenet_v2_x1_0",
          "regnet_y_800mf", "convnext_tiny", "swin_t", "vit_b_16")


def _base(name: str) -> str:
    """``maximum3`` -> ``maximum``: the BlockBuilder numbers a PrimFunc name it has seen."""
    return name.rstrip("0123456789")


@contextlib.contextmanager
def _attributing(origin: dict):
    """Record {PrimFunc name: ONNX op type} while the importer runs: ``emit_te`` is wrapped
    and the ONNX node being converted read from the importer's ``_construct_nodes`` frame
    (the same frame ``load._failing_node`` reads)."""
    from tvm import relax

    emit_te = relax.BlockBuilder.emit_te

    def wrapped(bb, *args, **kwargs):
        var = emit_te(bb, *args, **kwargs)
        frame, op = sys._getframe(1), "?"
        while frame is not None:
            if frame.f_code.co_name == "_construct_nodes" and "node" in frame.f_locals:
                op = frame.f_locals["node"].op_type
                break
            frame = frame.f_back
        value = bb.lookup_binding(var)
        if value is not None and isinstance(value, relax.Call) and value.args:
            origin[value.args[0].name_hint] = op
        return var

    relax.BlockBuilder.emit_te = wrapped
    try:
        yield origin
    finally:
        relax.BlockBuilder.emit_te = emit_te


def call_tirs(mod) -> collections.Counter:
    """PrimFunc name -> number of ``call_tir`` bindings of ``main`` calling it."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    out: collections.Counter = collections.Counter()

    def visit(e):
        if isinstance(e, relax.Call) and e.op.same_as(call_tir):
            out[e.args[0].name_hint] += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return out


def unplaceable(mod) -> list:
    """Op names of the nodes of ``main`` that no graph library (onnxruntime, openvino) can
    take: ``valid_nodes`` of their pattern rules."""
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.placement import valid_nodes
    from collage_tvm.registry import get_backend

    graph = DataflowGraph.from_module(mod)
    valid = set()
    for lib in ("onnxruntime", "openvino"):
        valid |= valid_nodes(graph, get_backend(lib))
    return [n.op_name for n in graph.nodes if n.index not in valid]


def survey(proto, shapes=None, count_nodes=False) -> dict:
    """One model: {"call_tir": [[onnx op, primfunc, before, after]], "unplaceable": ...}."""
    from collage_tvm.frontend import load_model, normalize_for_collage
    from collage_tvm.frontend.raise_tir import raise_call_tir

    origin: dict = {}
    with _attributing(origin), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = load_model(proto, input_shapes=shapes)
    before = normalize_for_collage(mod, raise_tir=False)
    after = raise_call_tir(before)
    left = call_tirs(after)
    rows = collections.defaultdict(lambda: [0, 0])
    for name, n in call_tirs(before).items():
        rows[(origin.get(name, "?"), _base(name))][0] += n
    for name, n in left.items():
        rows[(origin.get(name, "?"), _base(name))][1] += n
    out = {"call_tir": [[op, f, b, a] for (op, f), (b, a) in sorted(rows.items())]}
    if count_nodes:
        out["unplaceable"] = [collections.Counter(unplaceable(m)) for m in (before, after)]
        out["nodes"] = [len(m["main"].body.blocks[0].bindings) for m in (before, after)]
    return out


def node_suite() -> dict:
    """{case name: survey} over the onnx wheel's node tests, each as written and again with
    its inputs after the first made initializers (``CONSTANT``): the cases feed pads,
    repeats, scales and axes as graph inputs, which the importer refuses or converts
    dynamically, where an exported model holds constants."""
    from collage_tvm.tools.suites import input_shapes, onnx_cases

    out = {}
    for case in onnx_cases("node"):
        variants = [(case.name, case)]
        if len(case.inputs) > 1:
            variants.append((case.name + CONSTANT, _constant_inputs(case)))
        for name, c in variants:
            try:
                out[name] = survey(c.model, input_shapes(c))
            except Exception as err:  # noqa: BLE001 - an importer failure is not our question
                out[name] = {"error": f"{type(err).__name__}: {str(err)[:120]}"}
    return out


CONSTANT = " (inputs 2+ constant)"


def _constant_inputs(case):
    """``case`` with its graph inputs after the first bound to their test data."""
    import dataclasses

    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    keep = inputs[:1]
    for inp, arr in zip(inputs[1:], case.inputs[1:]):
        if isinstance(arr, (np.ndarray, np.generic)):
            model.graph.initializer.append(numpy_helper.from_array(np.asarray(arr), inp.name))
        else:  # a sequence or optional stays an input
            keep.append(inp)
    names = {i.name for i in keep} | inits
    kept = [i for i in model.graph.input if i.name in names]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    arrays = [a for inp, a in zip(inputs, case.inputs) if inp.name in names]
    return dataclasses.replace(case, model=model, inputs=arrays)


def model_suite(tmp: str) -> dict:
    """{model name: survey} over torchvision models (64x64) and a 2-layer BERT."""
    from collage_tvm.tools.suites import export_either, torchvision_model, transformers_model

    out = {}
    for name in (*MODELS, "bert"):
        model, inputs = transformers_model(name) if name == "bert" else torchvision_model(name)
        path = os.path.join(tmp, f"{name}.onnx")
        try:
            exporter = export_either(model, inputs, path)
            out[name] = dict(survey(path, count_nodes=True), exporter=exporter)
        except Exception as err:  # noqa: BLE001
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:120]}"}
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def slim_node(cases: dict) -> dict:
    """The node suite's survey as the JSON keeps it: the cases that left a ``call_tir`` (what
    the table shows), and how many imports were tried and succeeded."""
    return {"node": {name: r for name, r in cases.items() if r.get("call_tir")},
            "node_imports": {"tried": len(cases),
                             "imported": sum(1 for r in cases.values() if "error" not in r)}}


def table(results: dict) -> str:
    """Markdown: ONNX op | PrimFunc | Relax op | where seen | call_tirs before -> after."""
    rows = collections.defaultdict(lambda: [0, 0, set()])
    for suite, cases in results.items():
        if suite not in ("node", "models"):
            continue
        for name, r in cases.items():
            for op, func, before, after in r.get("call_tir", []):
                row = rows[(op, func)]
                row[0] += before
                row[1] += after
                row[2].add(name if suite == "models" else "node suite")
    counts = results.get("node_imports")
    lines = ([f"The node suite: {counts['tried']} imports tried, {counts['imported']} "
              f"succeeded, {len(results.get('node', {}))} of them left a `call_tir`.", ""]
             if counts else [])
    lines += ["| ONNX op | call_tir PrimFunc | raised to | call_tirs before -> after | seen in |",
              "|---|---|---|---|---|"]
    for (op, func), (before, after, seen) in sorted(rows.items()):
        node = len({name.replace(CONSTANT, "") for name, r in results.get("node", {}).items()
                    if any(c[0] == op and c[1] == func for c in r.get("call_tir", []))})
        where = sorted(s for s in seen if s != "node suite")
        if node:
            where.insert(0, f"{node} node cases")
        lines.append(f"| {op} | {func} | {RAISED_TO.get(func, '?')} | {before} -> "
                     f"{after} | {', '.join(where)} |")
    if "models" in results:
        lines += ["", "| model | nodes before -> after | no graph library can take: before | "
                  "after |",
                  "|---|---|---|---|"]
        for name, r in results["models"].items():
            if "unplaceable" not in r:
                lines.append(f"| {name} | | {r.get('error', '')} | |")
                continue

            def fmt(counter):
                total = sum(counter.values())
                return f"{total}" + (f" ({', '.join(f'{k} {v}' for k, v in sorted(counter.items()))})"
                                     if total else "")
            shown = name + (" (dynamo export)" if r.get("exporter") == "dynamo" else "")
            lines.append(f"| {shown} | {r['nodes'][0]} -> {r['nodes'][1]} | "
                         f"{fmt(r['unplaceable'][0])} | {fmt(r['unplaceable'][1])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("node", "models", "all"), default="all")
    parser.add_argument("--json", default="call_tir_survey.json", help="where to write JSON")
    args = parser.parse_args(argv)
    results = {}
    if args.suite in ("node", "all"):
        results.update(slim_node(node_suite()))
    if args.suite in ("models", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            results["models"] = model_suite(tmp)
    import onnx

    from .bench import machine

    results["machine"] = dict(machine(), onnx=onnx.__version__)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=dict)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
