"""The backend registry: the lowering interface, TVM's own pattern tables as a backend's
patterns (run through TVM's own checks on our CheckContext), built-ins registered up front."""
import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tvm import relax

import collage_tvm
from collage_tvm.graph import DataflowGraph
from collage_tvm.lowering import Lowering
from collage_tvm.candidates import CheckContext, generate_candidates
from collage_tvm.registry import (Backend, add_backend_pattern, add_backend_patterns_from_tvm,
                                  get_backend, register_backend)


def _gemm(bias_shape=(16,), relu=False, leak=False, m=4, k=8, n=16):
    """``[relu](x @ w + bias)`` (float32, static shapes), x a parameter, w and bias constants.
    ``leak``: the matmul's result is also an output of the function."""
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.const(rng.random((k, n), dtype="float32"))
    b = relax.const(rng.random(bias_shape, dtype="float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            mm = bb.emit(relax.op.matmul(x, w))
            y = bb.emit(relax.op.add(mm, b))
            if relu:
                y = bb.emit(relax.op.nn.relu(y))
            if leak:
                out = bb.emit_output(relax.Tuple([y, mm]))
            else:
                out = bb.emit_output(relax.op.nn.softmax(y))
        bb.emit_func_output(out)
    return bb.get()["main"]


@pytest.fixture(scope="module")
def cublas_lib():
    register_backend("cublas_test", kind="op", device="cuda")
    entries = add_backend_patterns_from_tvm("cublas_test", "cublas")
    return get_backend("cublas_test"), entries


def _found(func, backend) -> dict:
    graph = DataflowGraph(func)
    return {c.nodes: c.label for c in generate_candidates(graph, [backend])}


def test_tvm_table_is_added_in_tvm_priority_order(cublas_lib):
    from tvm.relax.backend.pattern_registry import get_patterns_with_prefix

    backend, entries = cublas_lib
    names = [str(fp.name) for fp in get_patterns_with_prefix("cublas")]
    assert [e.name for e in backend.patterns] == [e.name for e in entries] == names
    assert {"cublas.matmul", "cublas.matmul_bias", "cublas.matmul_bias_relu"} <= set(names)
    bias = next(e for e in entries if e.name == "cublas.matmul_bias")
    assert set(bias.annotations) == {"lhs", "rhs", "root", "bias"} and bias.check is not None


def test_tvm_cublas_patterns_match_gemm_bias_and_relu(cublas_lib):
    backend, _ = cublas_lib
    assert _found(_gemm(), backend) == {frozenset({0}): "cublas.matmul",
                                        frozenset({0, 1}): "cublas.matmul_bias"}
    assert _found(_gemm(relu=True), backend) == {
        frozenset({0}): "cublas.matmul", frozenset({0, 1}): "cublas.matmul_bias",
        frozenset({0, 1, 2}): "cublas.matmul_bias_relu"}


def test_tvm_cublas_check_rejects_batched_bias_and_leaks(cublas_lib):
    backend, _ = cublas_lib
    # _check_matmul: cuBLAS only takes a bias vector (batch dims of the bias must be 1).
    assert _found(_gemm(bias_shape=(4, 16)), backend) == {frozenset({0}): "cublas.matmul"}
    assert _found(_gemm(bias_shape=(1, 16)), backend)[frozenset({0, 1})] == "cublas.matmul_bias"
    # The matmul result leaves the group: no fused candidate.
    assert _found(_gemm(leak=True), backend) == {frozenset({0}): "cublas.matmul"}


def test_check_context_has_every_field_tvm_checks_read(cublas_lib):
    from tvm.relax.backend.utils import has_leaking_intermediate_variables
    from tvm.relax.transform import PatternCheckContext

    tvm_fields = {"matched_expr", "annotated_expr", "matched_bindings", "var_usages",
                  "value_to_bound_var"}
    ours = {f.name for f in dataclasses.fields(CheckContext)}
    assert tvm_fields <= ours and {"nodes", "graph"} <= ours
    assert tvm_fields <= set(PatternCheckContext.__annotations__)

    seen = []
    register_backend("ctx_probe", kind="op")
    bias = next(e for e in cublas_lib[1] if e.name == "cublas.matmul_bias_relu")
    add_backend_pattern("ctx_probe", bias.pattern, name="ctx_probe.gemm",
                        annotations=bias.annotations, check=lambda ctx: seen.append(ctx) or True)
    func = _gemm(relu=True)
    graph = DataflowGraph(func)
    generate_candidates(graph, [get_backend("ctx_probe")])
    (ctx,) = seen
    mm, add, relu, soft = (n.var for n in graph.nodes)
    assert ctx.matched_expr.same_as(graph.nodes[2].value)
    assert ctx.annotated_expr["root"].same_as(graph.nodes[0].value)
    assert list(ctx.matched_bindings) == [mm, add, relu]
    assert ctx.matched_bindings[add].same_as(graph.nodes[1].value)
    assert ctx.var_usages[func.params[0]] == [mm] and ctx.var_usages[relu] == [soft]
    assert ctx.var_usages[soft] == []
    assert ctx.value_to_bound_var[ctx.matched_expr].same_as(relu)
    assert graph.nodes[3].value not in ctx.value_to_bound_var  # after the matched binding
    assert len(ctx.value_to_bound_var) == 3
    assert all(v.same_as(n.value) for v, n in zip(ctx.value_to_bound_var, graph.nodes))
    assert [n.index for n in ctx.nodes] == [0, 1, 2] and ctx.graph is graph
    # TVM's own helper runs on it: no leak here, a leak once the add has an outside user.
    assert not has_leaking_intermediate_variables(ctx)
    leaky = dataclasses.replace(ctx, var_usages={**ctx.var_usages, add: [relu, soft]})
    assert has_leaking_intermediate_variables(leaky)


def test_tvm_table_needs_a_known_backend_and_prefix():
    with pytest.raises(KeyError, match="no_such_backend"):
        add_backend_patterns_from_tvm("no_such_backend", "cublas")
    register_backend("empty_tvm", kind="op")
    with pytest.raises(ValueError, match="no pattern named 'nosuchprefix'"):
        add_backend_patterns_from_tvm("empty_tvm", "nosuchprefix")


def test_a_rule_of_regions_only_needs_regions():
    from collage_tvm.registry import add_backend_pattern_rule

    register_backend("regions_lib", kind="graph")
    with pytest.raises(ValueError, match="regions_only needs regions >= 1"):
        add_backend_pattern_rule("regions_lib", lambda n: True, regions_only=True)
    rule = add_backend_pattern_rule("regions_lib", lambda n: True, regions=2, regions_only=True)
    assert rule.regions_only and rule.regions == 2


class _NoLower(Lowering):
    def version(self):
        return "0"


class _DuckNoLower:
    def available(self):
        return True, ""

    def version(self):
        return "0"


class _Complete(Lowering):
    name = "complete"

    def version(self):
        return "complete-1"

    def lower(self, func):
        return lambda *args: args[0]


@pytest.mark.parametrize("spec", [_NoLower, _DuckNoLower, _DuckNoLower(),
                                  f"{__name__}:_NoLower"])
def test_lowering_missing_lower_is_a_clear_type_error(spec):
    b = Backend(name="half_done", lowering=spec)
    with pytest.raises(TypeError, match=r"backend 'half_done'.*missing lower"):
        b.get_lowering()
    ok, reason = b.available()  # never raises
    assert not ok and "TypeError" in reason and "missing lower" in reason


def test_complete_lowering_resolves_with_interface_defaults():
    b = Backend(name="complete", lowering=_Complete)
    low = b.get_lowering()
    assert isinstance(low, Lowering) and low.probe() is None
    assert b.available() == (True, "") and b.version() == "complete-1"
    assert collage_tvm.Lowering is Lowering
    for name in ("dnnl", "mkl", "onnxruntime", "openvino"):
        spec = get_backend(name).lowering
        mod, _, cls = spec.partition(":")
        assert issubclass(getattr(__import__(mod, fromlist=[cls]), cls), Lowering), name


def test_builtin_backend_can_be_extended_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import collage_tvm
        from tvm.relax.dpl import is_op, wildcard
        entry = collage_tvm.add_backend_pattern(
            "dnnl", is_op("relax.nn.softmax")(wildcard()), name="dnnl.extra")
        b = collage_tvm.get_backend("dnnl")
        assert b.patterns[-1] is entry and entry.name == "dnnl.extra", b.patterns[-1]
        assert len(b.patterns) > 1 and b.source.endswith("dnnl/patterns.py"), b.source
        # a user's registration still replaces the built-in
        collage_tvm.register_backend("dnnl", kind="op", device="cpu", lowering=None)
        assert collage_tvm.get_backend("dnnl").patterns == []
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
