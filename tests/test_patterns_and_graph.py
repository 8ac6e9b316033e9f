"""Graph view, post-dominators, pattern generator and the pattern-file loader."""
import numpy as np
import pytest
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.graph.subgraph import extract_function, function_key
from collage_tvm.candidates import generate_candidates
from collage_tvm.registry import PatternFileError, get_backend, load_pattern_file


def _conv_block(residual=True, c=8):
    """conv -> +bias -> relu -> conv -> +bias (-> +x) -> relu -> mean."""
    x = relax.Var("x", relax.TensorType((1, c, 8, 8), "float32"))
    rng = np.random.default_rng(0)
    w1 = relax.const(rng.random((c, c, 3, 3), dtype="float32"))
    w2 = relax.const(rng.random((c, c, 1, 1), dtype="float32"))
    b = relax.const(rng.random((1, c, 1, 1), dtype="float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w1, padding=[1, 1, 1, 1]))
            y = bb.emit(relax.op.add(y, b))
            y = bb.emit(relax.op.nn.relu(y))
            y = bb.emit(relax.op.nn.conv2d(y, w2))
            y = bb.emit(relax.op.add(y, b))
            if residual:
                y = bb.emit(relax.op.add(y, x))
            y = bb.emit(relax.op.nn.relu(y))
            out = bb.emit_output(relax.op.mean(y, axis=[2, 3]))
        bb.emit_func_output(out)
    return bb.get()["main"]


def test_graph_nodes_edges_and_post_dominators():
    g = DataflowGraph(_conv_block())
    assert [n.op_name for n in g.nodes] == [
        "relax.nn.conv2d", "relax.add", "relax.nn.relu", "relax.nn.conv2d", "relax.add",
        "relax.add", "relax.nn.relu", "relax.mean"]
    assert g.nodes[1].inputs == [0] and g.nodes[0].users == [1]
    assert g.outputs == [7]
    assert g.post_dominators() == [1, 2, 3, 4, 5, 6, 7, None]


def test_tvm_rule_emits_conv_epilogue_fusions_but_not_across_two_anchors():
    g = DataflowGraph(_conv_block())
    groups = {c.nodes for c in generate_candidates(g, [get_backend("tvm")])}
    assert frozenset({0, 1, 2}) in groups          # conv + bias + relu
    assert frozenset({3, 4, 5, 6}) in groups       # conv + bias + residual add + relu
    assert frozenset({6, 7}) in groups             # elementwise into a reduction sink
    assert not any({3, 7} <= g_ for g_ in groups)  # a conv epilogue never ends in a reduce
    assert frozenset({0, 1, 2, 3}) not in groups   # two convolutions never fuse
    assert all(frozenset([i]) in groups for i in range(len(g)))  # every op runs on TVM


def test_explicit_pattern_match_respects_escaping_intermediates():
    from tvm.relax.dpl import is_const, is_op, wildcard

    from collage_tvm.registry import add_backend_pattern, register_backend

    register_backend("toy_lib", kind="op")
    conv = is_op("relax.nn.conv2d")(wildcard(), is_const())
    add_backend_pattern("toy_lib", is_op("relax.add")(conv, is_const()), name="toy.conv_bias")
    g = DataflowGraph(_conv_block())
    found = {c.nodes for c in generate_candidates(g, [get_backend("toy_lib")])}
    assert found == {frozenset({0, 1}), frozenset({3, 4})}


def test_function_key_ignores_weight_values_but_not_shapes():
    g8, g8b, g4 = (DataflowGraph(_conv_block(c=c)) for c in (8, 8, 4))
    k = [function_key(extract_function(g, {0, 1, 2})[0]) for g in (g8, g8b, g4)]
    assert k[0] == k[1] and k[0] != k[2]


def test_pattern_file_with_error_is_reported_with_path_and_line(tmp_path):
    bad = tmp_path / "bad_backend.py"
    bad.write_text("from collage_tvm.registry import register_backend\n"
                   "register_backend('bad_backend')\n"
                   "undefined_name + 1\n")
    with pytest.raises(PatternFileError, match=r"bad_backend\.py:3: NameError"):
        load_pattern_file(bad)
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n")
    with pytest.raises(PatternFileError, match=r"syntax\.py:1: SyntaxError"):
        load_pattern_file(syntax)


def test_user_pattern_file_registers_a_backend(tmp_path):
    f = tmp_path / "mylib.py"
    f.write_text(
        "from tvm.relax.dpl import is_op, wildcard\n"
        "from collage_tvm.registry import register_backend, add_backend_pattern_rule\n"
        "register_backend('mylib', kind='op', device='cpu')\n"
        "add_backend_pattern_rule('mylib', lambda n: n.op_name == 'relax.nn.relu')\n")
    assert load_pattern_file(f) == ["mylib"]
    g = DataflowGraph(_conv_block())
    assert {c.nodes for c in generate_candidates(g, [get_backend("mylib")])} == {
        frozenset({2}), frozenset({6})}


def test_a_graph_library_offers_regions_up_to_the_whole_model():
    # PatternRule.regions: the nodes in topological order cut into 1, 2, 4, ... ranges;
    # each range's runs of valid nodes are candidates, the whole model among them. A node
    # the library cannot run ends a run.
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.candidates import generate_candidates
    from collage_tvm.registry import Backend, PatternRule

    xv = relax.Var("x", relax.TensorType((1, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = xv
            for k in range(12):
                y = bb.emit(relax.op.nn.relu(y) if k != 5 else relax.op.nn.softmax(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    graph = DataflowGraph(bb.get()["main"])
    n = len(graph)

    def lib(regions, skip=None):
        rule = PatternRule(valid_op=lambda node: node.index != skip, regions=regions)
        return Backend(name="lib", kind="graph", rules=[rule])

    def regions(cands):
        return sorted(sorted(c.nodes) for c in cands if c.label == "lib.region")

    found = regions(generate_candidates(graph, [lib(2)]))
    assert list(range(n)) in found                                   # the whole model
    assert list(range(n // 2)) in found and list(range(n // 2, n)) in found  # the halves
    assert not regions(generate_candidates(graph, [lib(0)]))
    assert not regions(generate_candidates(graph, [lib(2)], regions=False))  # rewrite costing
    cut = regions(generate_candidates(graph, [lib(1, skip=5)]))
    assert all(5 not in r for r in cut) and [0, 1, 2, 3, 4] in cut
    # A library whose builds take seconds (inductor) offers its regions and nothing else.
    only = Backend(name="lib", kind="graph",
                   rules=[PatternRule(valid_op=lambda node: True, regions=2, regions_only=True)])
    offered = generate_candidates(graph, [only])
    assert offered and all(c.label == "lib.region" for c in offered)
    assert regions(offered) == found


def test_a_region_holding_too_many_weights_is_not_offered(monkeypatch):
    import numpy as np

    from collage_tvm.graph import DataflowGraph
    from collage_tvm import candidates as generate
    from collage_tvm.candidates import generate_candidates
    from collage_tvm.registry import Backend, PatternRule

    xv = relax.Var("x", relax.TensorType((1, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = xv
            for _ in range(8):  # 8 matmuls of 16x16 float32 weights: 1 KiB each
                y = bb.emit(relax.op.matmul(y, relax.const(np.ones((16, 16), "float32"))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    graph = DataflowGraph(bb.get()["main"])
    lib = Backend(name="lib", kind="graph", rules=[PatternRule(valid_op=lambda n: True,
                                                               regions=1)])
    sizes = lambda: sorted(len(c.nodes) for c in generate_candidates(graph, [lib])  # noqa: E731
                           if c.label == "lib.region")
    assert max(sizes()) == len(graph)
    monkeypatch.setattr(generate, "REGION_MAX_BYTES", 5 * 1024)  # the halves fit, not the whole
    assert sizes() and max(sizes()) < len(graph)


def _relus_and_a_library():
    """(graph of 12 ReLUs, backends TVM and an external graph library "lib" taking every
    node, their candidates): a stage for fake cost tables."""
    from collage_tvm.registry import Backend, PatternRule

    xv = relax.Var("x", relax.TensorType((1, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = xv
            for _ in range(12):
                y = bb.emit(relax.op.nn.relu(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    graph = DataflowGraph(bb.get()["main"])
    lib = Backend(name="lib", kind="graph", lowering="never.lowered:Lowering",  # external
                  rules=[PatternRule(valid_op=lambda node: True, regions=1)])
    tvm_b = get_backend("tvm")
    return graph, {"lib": lib, "tvm": tvm_b}, generate_candidates(graph, [tvm_b, lib])


def test_regions_are_cut_around_a_tvm_kernel_that_beats_the_library_inside_them():
    # Regions come at even ranges of the topological order only: once the DP runs the model
    # as one library region, a TVM kernel that wins a node inside it (a tuned convolution)
    # can take that node only if someone offers the region's pieces around it. Fake costs:
    # a test of the search, not of the libraries.
    from collage_tvm.placer.carve import carved_regions
    from collage_tvm.placer.op_level import place

    graph, backends, cands = _relus_and_a_library()
    n = len(graph)
    whole = frozenset(range(n))

    def cost(c, tvm_at_6):
        if c.backend == "tvm":
            return tvm_at_6 if c.nodes == {6} else 2.0 * len(c.nodes)
        return {n: 5.0, n // 2: 3.0}.get(len(c.nodes), 1.0 * len(c.nodes))

    eps = {"lib": 0.0, "tvm": 0.0}
    costs = {c: cost(c, 0.1) for c in cands}
    first = place(graph.producers, cands, costs, eps)
    assert [g.nodes for g in first.groups] == [whole]
    cuts = []
    new = carved_regions(graph, first.groups, cands, costs, eps, backends, cuts=cuts)
    # The pieces around node 6: 0..5 (already offered: the first half) and 7..n-1.
    assert [sorted(c.nodes) for c in new] == [list(range(7, n))]
    assert all(c.backend == "lib" and c.label == "lib.region" for c in new)
    costs.update({c: 1.0 for c in new})
    (cut,) = cuts
    assert [c.nodes for c in cut.winners] == [{6}] and cut.region.nodes == whole
    assert cut.cost(cands + new, costs, eps) == pytest.approx(3.0 + 0.1 + 1.0)
    again = place(graph.producers, cands + new, costs, eps)
    assert sorted(sorted(g.nodes) for g in again.groups) == [list(range(6)), [6],
                                                             list(range(7, n))]
    assert again.cost < first.cost
    # No TVM kernel beats the library on its own nodes: nothing to carve. One that beats it
    # by too little to pay for the region's loss (its share of the region's 5 ms is 0.38):
    # nothing worth measuring.
    for tvm_at_6 in (1.5, 0.9):
        costs = {c: cost(c, tvm_at_6) for c in cands}
        assert not carved_regions(graph, place(graph.producers, cands, costs, eps).groups,
                                  cands, costs, eps, backends)


def test_carving_counts_a_library_time_never_measured_as_unknown_not_as_infinite():
    # A lean search leaves the libraries' single elementwise ops unmeasured (infinite in its
    # cost table). A TVM kernel on such a node is no winner against "infinity" (ResNet-50:
    # 22 region pieces measured for 38 s around untuned TVM kernels of 118 ms, none won);
    # one that beats a measured single-op time still is.
    import math

    from collage_tvm.placer.carve import carved_regions
    from collage_tvm.placer.op_level import place

    graph, backends, cands = _relus_and_a_library()
    n = len(graph)

    def cost(c):
        (i,) = c.nodes if len(c.nodes) == 1 else (None,)
        if c.backend == "tvm":
            return 0.1 if i in (6, 7) else 2.0 * len(c.nodes)
        if i is not None:
            return 1.0 if i % 2 == 0 else math.inf  # odd nodes: skipped by a lean search
        return 5.0 if len(c.nodes) == n else 1.0 * len(c.nodes)

    eps = {"lib": 0.0, "tvm": 0.0}
    costs = {c: cost(c) for c in cands}
    first = place(graph.producers, cands, costs, eps)
    assert [g.nodes for g in first.groups] == [frozenset(range(n))]
    cuts = []
    carved_regions(graph, first.groups, cands, costs, eps, backends, cuts=cuts)
    assert [[c.nodes for c in cut.winners] for cut in cuts] == [[{6}]]
    # Nothing measured alone on the library: no estimate, nothing carved.
    costs = {c: (math.inf if c.backend == "lib" and len(c.nodes) == 1 else v)
             for c, v in costs.items()}
    assert not carved_regions(graph, first.groups, cands, costs, eps, backends)


def test_a_tvm_group_lifts_the_constants_in_a_tuple_and_an_integer_scalar_index():
    """ViT's ``concat((cls_token, x))`` and ``take(qkv, R.const(0))`` as one TVM group: TVM
    refuses tensor constants inside a primitive function ("Tensor constants are not
    supported"), so both must become parameters; the group then builds and matches."""
    import tvm

    from collage_tvm.check import evaluate
    from collage_tvm.byoc import compile_placement
    from collage_tvm.placement import Candidate
    from collage_tvm.target import make_target

    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((3, 4, 8), "float32"))
    cls = relax.const(rng.normal(size=(1, 8)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.take(x, relax.const(1, "int64"), axis=0))
            c = bb.emit(relax.op.concat([cls, t], axis=0))
            out = bb.emit_output(relax.op.nn.relu(c))
        bb.emit_func_output(out)
    g = DataflowGraph(bb.get()["main"])
    target = make_target("llvm")
    ref = evaluate(tvm.compile(tvm.IRModule({"main": g.func}), target), g, target)
    tvm_b = get_backend("tvm")
    ex, _ = compile_placement(g, [Candidate("tvm", frozenset(range(len(g))))], {"tvm": tvm_b},
                              target)
    assert evaluate(ex, g, target, ref["outputs"])["match"]
