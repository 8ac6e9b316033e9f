"""Rewrite ``main`` so each chosen group is one call (the BYOC partitioning step).

- A TVM group of several ops becomes a private function marked ``Primitive``, so TVM's
  FuseOps leaves it alone and FuseTIR compiles it as exactly one kernel, as measured.
- A group placed on an external backend becomes a function with a ``Codegen`` attribute
  (``collage_<backend>``) and a ``global_symbol``; ``byoc.lower_external`` turns its calls
  into ``R.call_pure_packed`` to the backend's compiled callable.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..graph import GLOBALS_ATTR, DataflowGraph
from ..graph.subgraph import PART_ATTR, extract_function, function_key, substitute

CODEGEN_PREFIX = "collage_"


def partition(graph: DataflowGraph, groups, backends: dict) -> tvm.IRModule:
    """``groups``: candidates covering every node, in execution order. ``backends``: name -> Backend."""
    covered = sorted(i for g in groups for i in g.nodes)
    if covered != list(range(len(graph))):
        raise ValueError("placement does not cover every node exactly once")
    func = graph.func
    bb = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in graph.params]
    vmap = dict(zip(graph.params, params))
    attrs = dict(func.attrs) if func.attrs is not None else {}
    attrs.pop("global_symbol", None)
    attrs.pop(GLOBALS_ATTR, None)
    # A candidate measured alone that is one piece of a larger model (``PART_ATTR``) runs
    # as it will there: its library does not keep its threads spinning between calls.
    sole = len(groups) == 1 and not bool(attrs.pop(PART_ATTR, False))
    with bb.function("main", params, attrs or None):
        with bb.dataflow():
            for k, group in enumerate(groups):
                backend = backends[group.backend]
                nodes = [graph.nodes[i] for i in sorted(group.nodes)]
                if not backend.is_external and (len(nodes) == 1 or all(n.call is None for n in nodes)):
                    for n in nodes:  # a single TVM op stays inline; TVM compiles it as usual
                        value = substitute(n.value, vmap)
                        vmap[n.var] = (bb.match_cast(value, n.match_ty, name_hint=n.var.name)
                                       if n.match_ty is not None
                                       else bb.emit(value, name_hint=n.var.name))
                    continue
                # (a library returns tensors: a tuple leaving its region, field by field)
                sub, inputs, outputs, consts = extract_function(
                    graph, group.nodes, lift_constants=not backend.is_external,
                    flat_outputs=backend.is_external)
                if backend.is_external:
                    key = function_key(sub)
                    sub = sub.with_attrs({"Codegen": CODEGEN_PREFIX + backend.name,
                                          "global_symbol": f"collage.{backend.name}.{key}_{k}",
                                          "collage.label": group.label,
                                          "collage.sole_group": sole,
                                          "collage.group": k})
                    args = _args(bb, vmap, inputs)
                else:
                    sub = sub.with_attrs({"Primitive": True, "collage.label": group.label})
                    args = _args(bb, vmap, inputs) + list(consts)
                gv = bb.add_func(sub, f"collage_{backend.name}_g{k}")
                call = bb.emit(relax.Call(gv, args), name_hint=f"g{k}")
                _bind_results(bb, vmap, graph, call, outputs, backend.is_external)
            out = bb.emit_output(substitute(func.body.body, vmap))
        bb.emit_func_output(out)
    mod = bb.get()
    for gv, f in graph.globals.items():  # the PrimFuncs main's call_tir bindings run
        mod[gv] = f
    return mod


def _bind_results(bb, vmap: dict, graph: DataflowGraph, call, outputs: list,
                  flat: bool) -> None:
    """Each of a group's ``outputs`` (node indices) bound to its results of ``call``; with
    ``flat`` (``extract_function``'s ``flat_outputs``) a tuple-typed output's fields are
    results of their own, made a tuple again for the groups that take it."""
    tupled = [flat and isinstance(graph.nodes[i].var.ty, relax.TupleType) for i in outputs]
    fields = [len(graph.nodes[i].var.ty.fields) if tup else 1
              for i, tup in zip(outputs, tupled)]
    if sum(fields) == 1 and not any(tupled):
        vmap[graph.nodes[outputs[0]].var] = call
        return
    results = ([call] if sum(fields) == 1 else
               [bb.emit(relax.TupleGetItem(call, j)) for j in range(sum(fields))])
    j = 0
    for i, n, tup in zip(outputs, fields, tupled):
        vmap[graph.nodes[i].var] = bb.emit(relax.Tuple(results[j:j + n])) if tup else results[j]
        j += n


def _args(bb, vmap: dict, inputs: list) -> list:
    """A group's call arguments (``extract_function``'s ``inputs``): a var's value, or a
    field of a tuple's, taken out before the call."""
    return [vmap[v] if not isinstance(v, tuple)
            else bb.emit(relax.TupleGetItem(vmap[v[0]], v[1])) for v in inputs]
