"""The mkl backend: pattern file (collage_tvm/backends/mkl/patterns.py) and MKL GEMM lowering
(collage_tvm/backends/mkl/)."""
import os

import numpy as np
import pytest


import tvm
from tvm import relax

from collage_tvm.backends.mkl import MklLowering

from collage_tvm.graph import DataflowGraph
from collage_tvm.graph.subgraph import extract_function
from collage_tvm.candidates import generate_candidates
from collage_tvm.registry import get_backend, load_pattern_file

if not MklLowering().available()[0]:
    pytest.skip(f"MKL unavailable: {MklLowering().available()[1]}", allow_module_level=True)

RNG = np.random.default_rng(0)
PATTERN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "collage_tvm",
                            "backends", "mkl", "patterns.py")
op = relax.op


def _rand(*shape):
    return RNG.standard_normal(shape).astype("float32")


def _func(param_shapes, body, dtype="float32"):
    """A Relax function with one dataflow block; ``body(bb, *params)`` emits the ops."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(s, dtype)) for i, s in enumerate(param_shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            gv = bb.emit_output(body(bb, *params))
        bb.emit_func_output(gv)
    return bb.get()["main"]


def _mkl(func, *arrays):
    fn = MklLowering().lower(func)
    out = fn(*[tvm.runtime.tensor(a) for a in arrays])
    assert isinstance(out, tvm.runtime.Tensor)
    return out.numpy(), fn


def _tvm(func, *arrays):
    ex = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _const(a):
    return relax.const(a)


# ------------------------------------------------------------------ library, version, probe


def test_available_version_threading():
    low = MklLowering()
    assert low.available() == (True, "")
    ver = low.version()  # e.g. mkl-2026.2-20260915+gnu2
    assert ver.startswith("mkl-2026.2-") and "+gnu" in ver
    from collage_tvm.backends.mkl import _load, find_libmkl_rt

    mkl = _load(find_libmkl_rt())
    assert "Math Kernel Library" in mkl.version_string and mkl.threading == "gnu"
    assert mkl.threads == len(os.sched_getaffinity(0))


def test_bogus_library_path_reports_a_reason(tmp_path):
    ok, reason = MklLowering("/nonexistent/libmkl_rt.so.3").available()
    assert not ok and "/nonexistent/libmkl_rt.so.3" in reason
    fake = tmp_path / "libmkl_rt.so.3"
    fake.write_text("not a library")
    ok, reason = MklLowering(str(fake)).available()
    assert not ok and "cannot load MKL" in reason
    assert MklLowering(str(fake)).version() == "mkl-unavailable"


def test_small_gemms_run_on_one_thread():
    from collage_tvm.backends.mkl import SINGLE_THREAD_FLOPS

    small = _func([(32, 64)], lambda bb, p: op.matmul(p, _const(_rand(64, 256))))
    big = _func([(128, 256)], lambda bb, p: op.matmul(p, _const(_rand(256, 256))))
    assert 2 * 32 * 64 * 256 < SINGLE_THREAD_FLOPS < 2 * 128 * 256 * 256
    assert MklLowering().lower(small).mkl_threads == 1
    assert MklLowering().lower(big).mkl_threads == len(os.sched_getaffinity(0))
    x = _rand(32, 64)
    fn = MklLowering().lower(small)
    _close(fn(tvm.runtime.tensor(x)).numpy(), x @ fn.mkl_plan.rhs.src)


def test_probe_is_a_supported_kernel():
    low = MklLowering()
    out = low.lower(low.probe())(tvm.runtime.tensor(np.full((1, 1), 3.0, "float32")))
    np.testing.assert_array_equal(out.numpy(), [[3.0]])


# ------------------------------------------------------------------ lowering: numerics


@pytest.mark.parametrize("xshape,bshape", [((6, 32), (16,)), ((2, 5, 32), (1, 16)), ((2, 3, 4, 32), (1, 1, 16))])
def test_dense_bias_fused(xshape, bshape):
    x, w, b = _rand(*xshape), _rand(32, 16), _rand(*bshape)
    f = _func([x.shape], lambda bb, p: op.add(bb.emit(op.matmul(p, _const(w))), _const(b)))
    got, fn = _mkl(f, x)
    assert fn.mkl_plan.bias is not None and fn.__name__ == "mkl_sgemm"  # one GEMM, batch in M
    _close(got, x @ w + b)
    _close(got, _tvm(f, x))
    _close(fn(tvm.runtime.tensor(x)).numpy(), got)  # C is re-initialised on every call


def test_dense_transposed_constant_uses_transb():
    """``x @ permute_dims(W)`` with W (N, K), as frontends write nn.Linear: W read in place."""
    x, w, b = _rand(5, 24), _rand(10, 24), _rand(10)
    f = _func([x.shape], lambda bb, p: op.add(_const(b), bb.emit(op.matmul(p, bb.emit(op.permute_dims(_const(w)))))))
    got, fn = _mkl(f, x)
    assert fn.mkl_plan.rhs.trans and fn.mkl_plan.rhs.src.shape == (10, 24)
    _close(got, x @ w.T + b)


@pytest.mark.parametrize("ashape,bshape", [
    ((7, 20), (20, 9)),            # 2-D run-time rhs
    ((3, 7, 20), (3, 20, 9)),      # batched, equal batch
    ((2, 3, 7, 20), (2, 3, 20, 9)),
    ((7, 20), (4, 20, 9)),         # lhs shared by the batch (stride 0)
    ((1, 7, 20), (2, 4, 20, 9)),
    ((4, 7, 20), (20, 9)),         # rhs shared: folds into one GEMM
])
def test_matmul_runtime_rhs(ashape, bshape):
    a, bm = _rand(*ashape), _rand(*bshape)
    f = _func([a.shape, bm.shape], lambda bb, p, q: op.matmul(p, q))
    got, fn = _mkl(f, a, bm)
    assert not fn.mkl_plan.rhs.trans
    _close(got, np.matmul(a, bm))


@pytest.mark.parametrize("kshape,axes", [((9, 20), None), ((3, 9, 20), [0, 2, 1]), ((2, 3, 9, 20), [0, 1, 3, 2])])
def test_matmul_transb_runtime_no_copy(kshape, axes):
    """Attention's ``Q @ K^T``: K is passed in place with CblasTrans."""
    q, k, b = _rand(*kshape[:-2], 7, 20), _rand(*kshape), _rand(9)
    f = _func([q.shape, k.shape], lambda bb, p, r: op.add(bb.emit(op.matmul(p, bb.emit(op.permute_dims(r, axes)))),
                                                         _const(b)))
    got, fn = _mkl(f, q, k)
    assert fn.mkl_plan.rhs.trans and fn.mkl_plan.rhs.src == 1  # the parameter itself
    _close(got, q @ np.swapaxes(k, -1, -2) + b)
    _close(got, _tvm(f, q, k))


def test_transb_through_broadcast_and_reshape():
    """The form ``torch.matmul`` exports for 4-D: reshape(broadcast_to(permute_dims(k)))."""
    q, k = _rand(6, 5, 8), _rand(2, 3, 5, 8)

    def body(bb, p, r):
        kt = bb.emit(op.permute_dims(r, [0, 1, 3, 2]))
        kt = bb.emit(op.reshape(bb.emit(op.broadcast_to(kt, (2, 3, 8, 5))), (6, 8, 5)))
        return op.matmul(p, kt)

    got, fn = _mkl(_func([q.shape, k.shape], body), q, k)
    assert fn.mkl_plan.rhs.trans and fn.__name__ == "mkl_sgemm_batch_strided"
    _close(got, q @ np.swapaxes(k.reshape(6, 5, 8), -1, -2))


def test_output_is_aligned_fresh_and_zero_copy():
    x, w = _rand(4, 8), _rand(8, 8)
    fn = MklLowering().lower(_func([x.shape], lambda bb, p: op.matmul(p, _const(w))))
    xt = tvm.runtime.tensor(x)
    o1, o2 = fn(xt), fn(xt)
    assert o1.data_ptr() % 64 == 0 and o1.data_ptr() != o2.data_ptr()
    assert np.from_dlpack(o1).ctypes.data == o1.data_ptr()
    with pytest.raises(ValueError, match="expected"):
        fn(tvm.runtime.tensor(_rand(5, 8)))


def test_runs_inside_the_relax_vm_via_call_pure_packed():
    x, w, b = _rand(3, 16), _rand(16, 8), _rand(8)
    sub = _func([x.shape], lambda bb, p: op.add(bb.emit(op.matmul(p, _const(w))), _const(b)))
    tvm.register_global_func("collage.test_mkl.k0", MklLowering().lower(sub), override=True)
    bb = relax.BlockBuilder()
    px = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with bb.function("main", [px]):
        with bb.dataflow():
            y = bb.emit(op.call_pure_packed("collage.test_mkl.k0", px, ty_args=relax.TensorType((3, 8), "float32")))
            gv = bb.emit_output(op.nn.relu(y))
        bb.emit_func_output(gv)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    _close(vm["main"](tvm.runtime.tensor(x)).numpy(), np.maximum(x @ w + b, 0))


@pytest.mark.parametrize("case,message", [
    ("fp16", "float16"),
    ("relu", "relax.nn.relu after the matmul"),
    ("runtime_add", "only a constant bias"),
    ("bias_shape", "add of a [4, 1] operand"),
    ("mixed_batch", "mixed batch broadcast"),
    ("permute", "permute_dims with axes [1, 0, 2]"),
    ("no_matmul", "relax.nn.relu before the matmul"),
])
def test_unsupported_bodies_raise(case, message):
    w = _const(_rand(8, 4))
    if case == "fp16":
        f = _func([(4, 8)], lambda bb, p: op.matmul(p, _const(_rand(8, 4).astype("float16"))), dtype="float16")
    elif case == "relu":
        f = _func([(4, 8)], lambda bb, p: op.nn.relu(bb.emit(op.matmul(p, w))))
    elif case == "runtime_add":
        f = _func([(4, 8), (4, 4)], lambda bb, p, r: op.add(bb.emit(op.matmul(p, w)), r))
    elif case == "bias_shape":
        f = _func([(4, 8)], lambda bb, p: op.add(bb.emit(op.matmul(p, w)), _const(_rand(4, 1))))
    elif case == "mixed_batch":
        f = _func([(2, 1, 4, 8), (1, 3, 8, 4)], lambda bb, p, q: op.matmul(p, q))
    elif case == "permute":
        f = _func([(8, 2, 4), (2, 4, 8)], lambda bb, p, q: op.matmul(bb.emit(op.permute_dims(p, [1, 0, 2])), q))
    else:
        f = _func([(4, 8)], lambda bb, p: op.matmul(bb.emit(op.nn.relu(p)), w))
    with pytest.raises(NotImplementedError, match=r"^mkl: ") as err:
        MklLowering().lower(f)
    assert message in str(err.value)


# ------------------------------------------------------------------ pattern file


@pytest.fixture(scope="module")
def mkl_backend():
    assert "mkl" in load_pattern_file(PATTERN_FILE)
    return get_backend("mkl")


def _groups(func, backend):
    """{label: sorted node lists} of every candidate the pattern file offers on ``func``."""
    graph = DataflowGraph(func)
    out: dict = {}
    for c in generate_candidates(graph, [backend]):
        out.setdefault(c.label, []).append(sorted(c.nodes))
    return graph, out


def test_pattern_file_registers_backend(mkl_backend):
    assert mkl_backend.kind == "op" and mkl_backend.device == "cpu"
    assert mkl_backend.lowering == "collage_tvm.backends.mkl:MklLowering"
    names = [e.name for e in mkl_backend.patterns]
    assert names == ["mkl.dense", "mkl.dense_bias", "mkl.matmul", "mkl.matmul_bias",
                     "mkl.matmul_transb", "mkl.matmul_transb_bias"]
    assert all(e.check is not None and "root" in e.annotations for e in mkl_backend.patterns)


def test_patterns_match_the_intended_subgraphs(mkl_backend):
    w, wt, b = _const(_rand(32, 16)), _const(_rand(16, 32)), _const(_rand(16))

    def body(bb, x, k):
        d = bb.emit(op.add(bb.emit(op.matmul(x, w)), b))                # 0 matmul, 1 add: dense_bias
        t = bb.emit(op.matmul(x, bb.emit(op.permute_dims(wt))))         # 2 permute, 3 matmul: dense
        s = bb.emit(op.matmul(bb.emit(op.reshape(d, (2, 4, 16))),      # 4 reshape, 5 reshape,
                              bb.emit(op.permute_dims(bb.emit(op.reshape(t, (2, 4, 16))), [0, 2, 1]))))
        r = bb.emit(op.matmul(s, k))                                    # 6 permute, 7 matmul: transb
        return op.add(r, b)                                             # 8 matmul, 9 add: matmul_bias

    f = _func([(8, 32), (2, 4, 16)], body)
    graph, groups = _groups(f, mkl_backend)
    assert [n.op_name for n in graph.nodes][:4] == ["relax.matmul", "relax.add", "relax.permute_dims", "relax.matmul"]
    assert [0, 1] in groups["mkl.dense_bias"] and [0] in groups["mkl.dense"]
    assert [2, 3] in groups["mkl.dense"]
    assert [6, 7] in groups["mkl.matmul_transb"] and [7] in groups["mkl.matmul"]
    assert [8, 9] in groups["mkl.matmul_bias"]
    # Every offered group lowers and computes what TVM computes.
    for node_lists in groups.values():
        for nodes in node_lists:
            sub, inputs, _, _ = extract_function(graph, frozenset(nodes))
            xs = [_rand(*[int(d) for d in v.ty.shape.values]) for v in inputs]
            got, _ = _mkl(sub, *xs)
            _close(got, _tvm(sub, *xs))


def _accepts(backend, name, func):
    graph, groups = _groups(func, backend)
    return any(graph.nodes[g[-1]].var.same_as(func.body.body) for g in groups.get(name, []))


def test_checks_reject_what_mkl_cannot_run(mkl_backend):
    w = _const(_rand(32, 16))
    assert _accepts(mkl_backend, "mkl.dense", _func([(4, 32)], lambda bb, p: op.matmul(p, w)))
    # float16 / dynamic shapes / mixed batch broadcast / a bias that is not per column
    w16 = _const(_rand(32, 16).astype("float16"))
    assert not _accepts(mkl_backend, "mkl.dense", _func([(4, 32)], lambda bb, p: op.matmul(p, w16), "float16"))
    n = tvm.tirx.Var("n", "int64")
    assert not _accepts(mkl_backend, "mkl.dense", _func([(n, 32)], lambda bb, p: op.matmul(p, w)))
    mixed = _func([(2, 1, 4, 8), (1, 3, 8, 4)], lambda bb, p, q: op.matmul(p, q))
    assert not _accepts(mkl_backend, "mkl.matmul", mixed)
    wrong_bias = _func([(4, 32)], lambda bb, p: op.add(bb.emit(op.matmul(p, w)), _const(_rand(4, 1))))
    assert not _accepts(mkl_backend, "mkl.dense_bias", wrong_bias)
    # a constant rhs is dense's, not matmul's; a permute that is not a last-two swap is not transB
    assert not _accepts(mkl_backend, "mkl.matmul", _func([(4, 32)], lambda bb, p: op.matmul(p, w)))
    perm = _func([(3, 4, 8), (8, 3, 5)], lambda bb, p, q: op.matmul(p, bb.emit(op.permute_dims(q, [1, 0, 2]))))
    assert not _accepts(mkl_backend, "mkl.matmul_transb", perm)
    assert _accepts(mkl_backend, "mkl.matmul", perm)  # the permuted tensor as a plain input


def test_float16_matmul_is_not_matched(mkl_backend):
    f = _func([(4, 8), (8, 4)], lambda bb, p, q: op.matmul(p, q), dtype="float16")
    assert generate_candidates(DataflowGraph(f), [mkl_backend]) == []


# ------------------------------------------------------------------ through the frontends


def test_torch_linear_and_attention_via_load_model(mkl_backend):
    torch = pytest.importorskip("torch")
    from collage_tvm.frontend import load_model
    from collage_tvm.frontend.load import normalize_for_collage

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32, bias=False)

        def forward(self, x):
            q = self.q(x).reshape(2, 8, 4, 8).permute(0, 2, 1, 3)
            k = self.k(x).reshape(2, 8, 4, 8).permute(0, 2, 1, 3)
            return q @ k.transpose(-2, -1)

    torch.manual_seed(0)
    m, x = Attn().eval(), torch.randn(2, 8, 32)
    graph = DataflowGraph(normalize_for_collage(load_model(m, (x,)))["main"])
    cands = generate_candidates(graph, [mkl_backend])
    ops = lambda c: [graph.nodes[i].op_name for i in sorted(c.nodes)]  # noqa: E731
    by_label = {}
    for c in cands:
        by_label.setdefault(c.label, []).append(c)
    assert ["relax.matmul", "relax.add"] in [ops(c) for c in by_label["mkl.dense_bias"]]  # q = Linear
    assert len(by_label["mkl.dense"]) == 2                                               # q and k matmuls
    (transb,) = by_label["mkl.matmul_transb"]                                            # Q @ K^T
    assert ops(transb) == ["relax.permute_dims", "relax.broadcast_to", "relax.reshape", "relax.matmul"]
    for c in by_label["mkl.dense_bias"] + [transb]:
        sub, inputs, _, _ = extract_function(graph, c.nodes)
        fn = MklLowering().lower(sub)
        assert c is not transb or fn.mkl_plan.rhs.trans
        xs = [_rand(*[int(d) for d in v.ty.shape.values]) for v in inputs]
        _close(fn(*[tvm.runtime.tensor(a) for a in xs]).numpy(), _tvm(sub, *xs))


def test_build_small_mlp_places_matmuls_on_mkl(tmp_path):
    torch = pytest.importorskip("torch")
    import collage_tvm

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            return self.l2(torch.relu(self.l1(x)))

    torch.manual_seed(0)
    m, x = MLP().eval(), torch.randn(32, 64)
    db = str(tmp_path / "c.db")
    ex = collage_tvm.build(m, "llvm", backends=["tvm", "mkl"], db=db, example_inputs=(x,), progress=False,
                           graph_level=False, compare=False)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    out = out if hasattr(out, "numpy") else out[0]
    # TVM-only reference: the same imported module, compiled by TVM alone.
    from collage_tvm.frontend import load_model

    ref = relax.VirtualMachine(tvm.compile(load_model(m, (x,)), target="llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(x.numpy()))
    ref = ref if hasattr(ref, "numpy") else ref[0]
    _close(out.numpy(), ref.numpy())
    _close(out.numpy(), m(x).detach().numpy())
    # The placement (read back from the placement log): every matmul runs on mkl.
    res = collage_tvm.optimize(m, "llvm", backends=["tvm", "mkl"], db=db, example_inputs=(x,), progress=False,
                               graph_level=False, compare=False)
    assert res.report.placement_from_log
    placed = {i: g.backend for g in res.placement.groups for i in g.nodes}
    matmuls = [n.index for n in res.graph.nodes if n.op_name == "relax.matmul"]
    assert len(matmuls) == 2 and all(placed[i] == "mkl" for i in matmuls), (res.placement.groups, res.report)


# ------------------------------------------------------------------ bf16 (issue #17)

@pytest.mark.skipif(not get_backend("mkl_bf16").available()[0],
                    reason=f"mkl_bf16: {get_backend('mkl_bf16').available()[1]}")
@pytest.mark.parametrize("case", ["dense_bias", "dense_transposed", "batched", "shared_lhs",
                                  "qk_transb"])
def test_bf16_variant_gemms_in_bf16_between_f32_tensors(case):
    """mkl_bf16 (cblas_gemm_bf16bf16f32): the error is bf16 rounding of A and B (above
    f32's, within the bf16 budget) in every GEMM form the f32 backend offers."""
    from collage_tvm.backends.mkl import MklBf16Lowering
    from collage_tvm.precision import relative_error

    if case == "dense_bias":
        x, w, b = _rand(2, 5, 64), _rand(64, 24), _rand(24)
        f = _func([x.shape], lambda bb, p: op.add(bb.emit(op.matmul(p, _const(w))), _const(b)))
        args = (x,)
    elif case == "dense_transposed":
        x, w = _rand(6, 64), _rand(24, 64)
        f = _func([x.shape], lambda bb, p: op.matmul(p, bb.emit(op.permute_dims(_const(w)))))
        args = (x,)
    elif case in ("batched", "shared_lhs"):
        a = _rand(3, 7, 64) if case == "batched" else _rand(7, 64)
        bm = _rand(3, 64, 9)
        f = _func([a.shape, bm.shape], lambda bb, p, q: op.matmul(p, q))
        args = (a, bm)
    else:
        q, k = _rand(2, 3, 5, 64), _rand(2, 3, 6, 64)
        f = _func([q.shape, k.shape], lambda bb, p, r: op.matmul(
            p, bb.emit(op.permute_dims(r, [0, 1, 3, 2]))))
        args = (q, k)
    want = _tvm(f, *args)
    fn = MklBf16Lowering().lower(f)
    got = fn(*[tvm.runtime.tensor(a) for a in args]).numpy()
    assert fn.__name__ == "mkl_gemm_bf16bf16f32" and got.dtype == np.float32
    err = relative_error([got], [want])
    assert 1e-5 < err < 2e-2, err
    assert MklBf16Lowering().version().endswith("-bf16")
