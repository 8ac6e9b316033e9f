"""The dnnl backend: pattern file (collage_tvm/backends/dnnl/patterns.py) and oneDNN lowering
(collage_tvm/backends/dnnl/)."""
import gc
import os
from types import SimpleNamespace

import numpy as np
import pytest


torch = pytest.importorskip("torch")
import tvm
from tvm import relax

from collage_tvm.backends.dnnl import DnnlLowering

from collage_tvm.registry import get_backend, load_pattern_file

F = torch.nn.functional
RNG = np.random.default_rng(0)
PATTERN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "collage_tvm",
                            "backends", "dnnl", "patterns.py")


def _rand(*shape):
    return RNG.standard_normal(shape).astype("float32")


def _func(param_shapes, body, dtype="float32"):
    """A Relax function with one dataflow block; ``body(bb, *params)`` emits the ops."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(s, dtype)) for i, s in enumerate(param_shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = body(bb, *params)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()["main"]


def _call(func, *arrays):
    fn = DnnlLowering().lower(func)
    out = fn(*[tvm.runtime.tensor(a) for a in arrays])
    assert isinstance(out, tvm.runtime.Tensor)
    return out.numpy()


def _close(got, want):
    np.testing.assert_allclose(got, want.detach().numpy() if hasattr(want, "detach") else want,
                               rtol=1e-4, atol=1e-4)


T = torch.from_numpy
op = relax.op


# ------------------------------------------------------------------ lowering: numerics


def test_available_and_version():
    low = DnnlLowering()
    assert low.available() == (True, "")
    ver = low.version()
    assert ver.startswith("onednn-") and f"+torch-{torch.__version__.split('+')[0]}" in ver
    cfg = torch.__config__.show()
    assert ver.split("+")[0].removeprefix("onednn-") in cfg  # read from the library, e.g. 3.12.0


def test_probe_is_a_supported_kernel():
    """The engine's switching-cost probe must be something dnnl runs (not the default add)."""
    low = DnnlLowering()
    out = low.lower(low.probe())(tvm.runtime.tensor(np.full((1, 1), 3.0, "float32")))
    np.testing.assert_array_equal(out.numpy(), [[3.0]])


def test_conv2d_bias_relu():
    x, w, b = _rand(2, 8, 15, 15), _rand(16, 8, 3, 3), _rand(16)
    f = _func([x.shape], lambda bb, p: op.nn.relu(bb.emit(op.add(
        bb.emit(op.nn.conv2d(p, relax.const(w), strides=2, padding=1)), relax.const(b.reshape(1, 16, 1, 1))))))
    _close(_call(f, x), F.relu(F.conv2d(T(x), T(w), T(b), stride=2, padding=1)))


@pytest.mark.parametrize("residual_first", [False, True])
def test_conv2d_bias_add_relu_residual_param(residual_first):
    x, r, w, b = _rand(1, 8, 12, 12), _rand(1, 8, 12, 12), _rand(8, 8, 3, 3), _rand(8)

    def body(bb, p, res):
        y = bb.emit(op.add(bb.emit(op.nn.conv2d(p, relax.const(w), padding=1)), relax.const(b.reshape(1, 8, 1, 1))))
        return op.nn.relu(bb.emit(op.add(res, y) if residual_first else op.add(y, res)))

    f = _func([x.shape, r.shape], body)
    _close(_call(f, x, r), F.relu(F.conv2d(T(x), T(w), T(b), padding=1) + T(r)))


def test_conv2d_add_no_bias_and_conv2d_plain():
    x, r, w = _rand(1, 4, 9, 9), _rand(1, 6, 9, 9), _rand(6, 4, 1, 1)
    f = _func([x.shape, r.shape], lambda bb, p, res: op.add(bb.emit(op.nn.conv2d(p, relax.const(w))), res))
    _close(_call(f, x, r), F.conv2d(T(x), T(w)) + T(r))
    f = _func([x.shape], lambda bb, p: op.nn.conv2d(p, relax.const(w)))
    _close(_call(f, x), F.conv2d(T(x), T(w)))


@pytest.mark.parametrize("groups,cin,cout", [(2, 8, 12), (16, 16, 16)])
def test_grouped_conv2d_bias(groups, cin, cout):
    x, w, b = _rand(1, cin, 10, 10), _rand(cout, cin // groups, 3, 3), _rand(cout)
    f = _func([x.shape], lambda bb, p: op.add(
        bb.emit(op.nn.conv2d(p, relax.const(w), padding=1, dilation=2 if groups == 2 else 1, groups=groups)),
        relax.const(b.reshape(1, cout, 1, 1))))
    want = F.conv2d(T(x), T(w), T(b), padding=1, dilation=2 if groups == 2 else 1, groups=groups)
    _close(_call(f, x), want)


def test_conv3d_bias_and_relu():
    x, w, b = _rand(1, 4, 6, 8, 8), _rand(8, 4, 3, 3, 3), _rand(8)
    f = _func([x.shape], lambda bb, p: op.add(
        bb.emit(op.nn.conv3d(p, relax.const(w), padding=1)), relax.const(b.reshape(1, 8, 1, 1, 1))))
    _close(_call(f, x), F.conv3d(T(x), T(w), T(b), padding=1))
    f = _func([x.shape], lambda bb, p: op.nn.relu(bb.emit(op.nn.conv3d(p, relax.const(w), strides=2))))
    _close(_call(f, x), F.relu(F.conv3d(T(x), T(w), stride=2)))


@pytest.mark.parametrize("xshape,bshape", [((4, 32), (16,)), ((2, 3, 32), (1, 16))])
def test_dense_bias(xshape, bshape):
    x, w, b = _rand(*xshape), _rand(32, 16), _rand(*bshape)
    f = _func([x.shape], lambda bb, p: op.add(bb.emit(op.matmul(p, relax.const(w))), relax.const(b)))
    _close(_call(f, x), T(x) @ T(w) + T(b))


def test_dense_transposed_weight_bias_relu():
    """``x @ permute_dims(W)`` with W (N, K), as torch frontends emit for nn.Linear."""
    x, w, b = _rand(5, 24), _rand(10, 24), _rand(10)
    f = _func([x.shape], lambda bb, p: op.nn.relu(bb.emit(op.add(
        bb.emit(op.matmul(p, bb.emit(op.permute_dims(relax.const(w))))), relax.const(b)))))
    _close(_call(f, x), F.relu(F.linear(T(x), T(w), T(b))))


@pytest.mark.parametrize("gelu,approx", [(op.nn.gelu, "none"), (op.nn.gelu_tanh, "tanh")])
def test_dense_bias_gelu(gelu, approx):
    x, w, b = _rand(8, 32), _rand(32, 48), _rand(48)
    f = _func([x.shape], lambda bb, p: gelu(bb.emit(op.add(bb.emit(op.matmul(p, relax.const(w))),
                                                           relax.const(b)))))
    _close(_call(f, x), F.gelu(T(x) @ T(w) + T(b), approximate=approx))


def test_dense_bias_add_relu():
    x, r, w, b = _rand(2, 6, 32), _rand(2, 6, 16), _rand(32, 16), _rand(16)
    f = _func([x.shape, r.shape], lambda bb, p, res: op.nn.relu(bb.emit(op.add(
        res, bb.emit(op.add(bb.emit(op.matmul(p, relax.const(w))), relax.const(b)))))))
    _close(_call(f, x, r), F.relu(T(x) @ T(w) + T(b) + T(r)))


def test_matmul_two_runtime_tensors_bias_relu():
    a, bmat, b = _rand(7, 20), _rand(20, 9), _rand(9)
    f = _func([a.shape, bmat.shape], lambda bb, p, q: op.nn.relu(bb.emit(op.add(
        bb.emit(op.matmul(p, q)), relax.const(b)))))
    _close(_call(f, a, bmat), F.relu(T(a) @ T(bmat) + T(b)))


def test_output_is_zero_copy_and_outlives_gc():
    x, w = _rand(1, 4, 8, 8), _rand(4, 4, 3, 3)
    f = _func([x.shape], lambda bb, p: op.nn.relu(bb.emit(op.nn.conv2d(p, relax.const(w), padding=1))))
    fn = DnnlLowering().lower(f)
    xt = tvm.runtime.tensor(x)
    out = fn(xt)
    assert torch.from_dlpack(out).data_ptr() == out.data_ptr()  # the torch result itself, no copy
    del fn
    gc.collect()
    _close(out.numpy(), F.relu(F.conv2d(T(x), T(w), padding=1)))


def test_runs_inside_the_relax_vm_via_call_pure_packed():
    x, r, w, b = _rand(1, 8, 6, 6), _rand(1, 8, 6, 6), _rand(8, 8, 3, 3), _rand(8)
    sub = _func([x.shape, r.shape], lambda bb, p, res: op.nn.relu(bb.emit(op.add(bb.emit(op.add(
        bb.emit(op.nn.conv2d(p, relax.const(w), padding=1)), relax.const(b.reshape(1, 8, 1, 1)))), res))))
    tvm.register_global_func("collage.test_dnnl.k0", DnnlLowering().lower(sub), override=True)
    bb = relax.BlockBuilder()
    px = relax.Var("x", relax.TensorType(x.shape, "float32"))
    pr = relax.Var("r", relax.TensorType(r.shape, "float32"))
    with bb.function("main", [px, pr]):
        with bb.dataflow():
            y = bb.emit(op.call_pure_packed("collage.test_dnnl.k0", px, pr,
                                            ty_args=relax.TensorType(x.shape, "float32")))
            gv = bb.emit_output(op.add(y, y))
        bb.emit_func_output(gv)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(r)).numpy()
    _close(got, 2 * F.relu(F.conv2d(T(x), T(w), T(b), padding=1) + T(r)))


@pytest.mark.parametrize("case,message", [
    ("sigmoid", "relax.sigmoid is not supported"),
    ("asym_pad", "asymmetric padding"),
    ("batched_runtime_matmul", "batched matmul of two run-time tensors"),
    ("fp16", "float16"),
    ("broadcast_residual", "add of a [1, 8, 1, 6] operand"),
    ("no_anchor", "relax.nn.relu (a group must start with conv2d, conv3d or matmul)"),
    ("nhwc", "layouts NHWC/OIHW"),
])
def test_unsupported_bodies_raise(case, message):
    w = relax.const(_rand(8, 8, 3, 3))
    if case == "sigmoid":
        f = _func([(1, 8, 6, 6)], lambda bb, p: op.sigmoid(bb.emit(op.nn.conv2d(p, w, padding=1))))
    elif case == "asym_pad":
        f = _func([(1, 8, 6, 6)], lambda bb, p: op.nn.conv2d(p, w, padding=(0, 0, 1, 1)))
    elif case == "batched_runtime_matmul":
        f = _func([(2, 3, 4), (2, 4, 5)], lambda bb, p, q: op.matmul(p, q))
    elif case == "fp16":
        w16 = relax.const(_rand(8, 8, 3, 3).astype("float16"))
        f = _func([(1, 8, 6, 6)], lambda bb, p: op.nn.conv2d(p, w16, padding=1), dtype="float16")
    elif case == "broadcast_residual":
        f = _func([(1, 8, 6, 6), (1, 8, 1, 6)], lambda bb, p, q: op.add(bb.emit(op.nn.conv2d(p, w, padding=1)), q))
    elif case == "no_anchor":
        f = _func([(1, 8, 6, 6)], lambda bb, p: op.nn.relu(p))
    else:
        f = _func([(1, 6, 6, 8)], lambda bb, p: op.nn.conv2d(p, w, padding=1, data_layout="NHWC"))
    with pytest.raises(NotImplementedError, match=r"^dnnl: ") as err:
        DnnlLowering().lower(f)
    assert message in str(err.value)


# ------------------------------------------------------------------ pattern file


@pytest.fixture(scope="module")
def dnnl_backend():
    assert "dnnl" in load_pattern_file(PATTERN_FILE)
    return get_backend("dnnl")


def _entry(backend, name):
    return next(e for e in backend.patterns if e.name == name)


def _accepts(entry, func):
    """Does ``entry`` match the function's returned expression and pass its check?"""
    var2val = relax.analysis.get_var2val(func)
    expr = var2val[func.body.body]
    if not entry.pattern.match(expr, var2val):
        return False
    matched = entry.pattern.extract_matched_expr(expr, var2val)
    ctx = SimpleNamespace(annotated_expr={k: matched[p] for k, p in entry.annotations.items() if p in matched},
                          matched_expr=expr)
    return entry.check is None or bool(entry.check(ctx))


def test_pattern_file_registers_backend(dnnl_backend):
    assert dnnl_backend.kind == "op" and dnnl_backend.device == "cpu"
    assert dnnl_backend.lowering == "collage_tvm.backends.dnnl:DnnlLowering"
    names = [e.name for e in dnnl_backend.patterns]
    assert len(names) >= 10 and len(set(names)) == len(names)
    for n in ("dnnl.conv2d_bias_relu", "dnnl.conv2d_bias_add_relu", "dnnl.conv3d_bias", "dnnl.dense_bias",
              "dnnl.dense_bias_gelu", "dnnl.matmul", "dnnl.conv2d_add_relu"):
        assert n in names
    assert all(e.check is not None and "root" in e.annotations for e in dnnl_backend.patterns)


def test_registry_resolves_the_lowering(dnnl_backend):
    """``lowering="collage_tvm.backends.dnnl:DnnlLowering"`` resolves (collage_tvm/backends/dnnl/)."""
    import importlib.util

    if importlib.util.find_spec("collage_tvm.backends") is None:
        pytest.skip("collage_tvm.backends is not installed (pip install -e .)")
    assert dnnl_backend.available() == (True, "")
    assert dnnl_backend.version() == DnnlLowering().version()


def test_dynamic_shapes_are_rejected(dnnl_backend):
    n = tvm.tirx.Var("n", "int64")
    w = relax.const(_rand(32, 16))
    f = _func([(n, 32)], lambda bb, p: op.matmul(p, w))
    assert not _accepts(_entry(dnnl_backend, "dnnl.dense"), f)
    with pytest.raises(NotImplementedError, match="dynamic shape"):
        DnnlLowering().lower(f)


def _conv_bias_relu(bias_shape=(1, 16, 1, 1), dtype="float32", layout="NCHW", padding=1, groups=1):
    w = relax.const(_rand(16, 8 // groups, 3, 3).astype(dtype))
    b = relax.const(_rand(*bias_shape).astype(dtype))
    shape = (1, 8, 10, 10) if layout == "NCHW" else (1, 10, 10, 8)
    return _func([shape], lambda bb, p: op.nn.relu(bb.emit(op.add(bb.emit(op.nn.conv2d(
        p, w, padding=padding, groups=groups, data_layout=layout)), b))), dtype=dtype)


def test_conv2d_patterns_match_and_check(dnnl_backend):
    e = _entry(dnnl_backend, "dnnl.conv2d_bias_relu")
    assert _accepts(e, _conv_bias_relu())
    assert _accepts(e, _conv_bias_relu(bias_shape=(16, 1, 1)))
    assert _accepts(e, _conv_bias_relu(groups=2))
    assert not _accepts(e, _conv_bias_relu(bias_shape=(1, 1, 10, 10)))  # not per channel
    assert not _accepts(e, _conv_bias_relu(dtype="float16"))
    assert not _accepts(e, _conv_bias_relu(padding=(0, 0, 1, 1)))
    assert not _accepts(_entry(dnnl_backend, "dnnl.conv2d_bias"), _conv_bias_relu())  # root is the relu
    assert not _accepts(_entry(dnnl_backend, "dnnl.conv3d_bias_relu"), _conv_bias_relu())


@pytest.mark.parametrize("rshape,ok", [((1, 16, 10, 10), True), ((1, 16, 1, 10), False)])
def test_conv2d_residual_pattern_needs_same_shape(dnnl_backend, rshape, ok):
    w, b = relax.const(_rand(16, 8, 3, 3)), relax.const(_rand(1, 16, 1, 1))
    f = _func([(1, 8, 10, 10), rshape], lambda bb, p, r: op.nn.relu(bb.emit(op.add(
        r, bb.emit(op.add(bb.emit(op.nn.conv2d(p, w, padding=1)), b))))))
    assert _accepts(_entry(dnnl_backend, "dnnl.conv2d_bias_add_relu"), f) is ok


def test_dense_and_matmul_patterns(dnnl_backend):
    w, b = relax.const(_rand(32, 16)), relax.const(_rand(16))
    dense = _func([(4, 32)], lambda bb, p: op.nn.gelu(bb.emit(op.add(bb.emit(op.matmul(p, w)), b))))
    assert _accepts(_entry(dnnl_backend, "dnnl.dense_bias_gelu"), dense)
    assert not _accepts(_entry(dnnl_backend, "dnnl.matmul_bias_gelu"), dense)  # constant rhs: dense
    transposed = _func([(4, 16)], lambda bb, p: op.matmul(p, bb.emit(op.permute_dims(w))))
    assert _accepts(_entry(dnnl_backend, "dnnl.dense"), transposed)
    wrong_bias = _func([(4, 32)], lambda bb, p: op.add(bb.emit(op.matmul(p, w)), relax.const(_rand(4, 1))))
    assert not _accepts(_entry(dnnl_backend, "dnnl.dense_bias"), wrong_bias)
    runtime = _func([(4, 32), (32, 16)], lambda bb, p, q: op.matmul(p, q))
    assert _accepts(_entry(dnnl_backend, "dnnl.matmul"), runtime)
    batched = _func([(2, 4, 32), (2, 32, 16)], lambda bb, p, q: op.matmul(p, q))
    assert not _accepts(_entry(dnnl_backend, "dnnl.matmul"), batched)


def test_every_accepted_pattern_lowers(dnnl_backend):
    """What the patterns offer, the lowering runs (one representative per family)."""
    f = _conv_bias_relu(groups=2)
    assert _accepts(_entry(dnnl_backend, "dnnl.conv2d_bias_relu"), f)
    x = _rand(1, 8, 10, 10)
    fn = DnnlLowering().lower(f)
    assert fn(tvm.runtime.tensor(x)).numpy().shape == (1, 16, 10, 10)


def test_conv3d_bias_shaped_like_a_1x1x1_output_is_a_bias_not_a_second_residual():
    """resnet3d (zoo, small): conv3d on a 1x1x1 map + a [1,C,1,1,1] bias + a residual."""
    from collage_tvm.check import evaluate
    from collage_tvm.byoc import compile_placement
    from collage_tvm.placement import Candidate
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.registry import get_backend
    from collage_tvm.target import make_target

    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 8, 1, 1, 1), "float32"))
    r = relax.Var("r", relax.TensorType((1, 16, 1, 1, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            w = rng.uniform(-1, 1, (16, 8, 1, 1, 1)).astype("float32")
            y = bb.emit(relax.op.nn.conv3d(x, relax.const(w)))
            b = rng.uniform(-1, 1, (1, 16, 1, 1, 1)).astype("float32")
            y = bb.emit(relax.op.add(y, relax.const(b)))
            y = bb.emit(relax.op.add(y, r))
            y = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(y)
    g, t = DataflowGraph(bb.get()["main"]), make_target("llvm")
    ref = evaluate(tvm.compile(tvm.IRModule({"main": g.func}), t), g, t)
    backends = {"tvm": get_backend("tvm"), "dnnl": get_backend("dnnl")}
    ex, _ = compile_placement(g, [Candidate("dnnl", frozenset(range(4)))], backends, t)
    assert evaluate(ex, g, t, ref["outputs"])["match"]


# ------------------------------------------------------------------ bf16 (issue #17)

BF16_OK = get_backend("dnnl_bf16").available()


@pytest.mark.skipif(not BF16_OK[0], reason=f"dnnl_bf16: {BF16_OK[1]}")
@pytest.mark.parametrize("kind", ["conv2d_bias_add_relu", "dense_bias_gelu", "matmul_bias"])
def test_bf16_variant_computes_in_bf16_between_f32_tensors(kind):
    """dnnl_bf16: f32 in and out, bf16 inside: the error is bf16 rounding (well above f32's,
    well within the bf16 budget), and the f32 lowering of the same function stays exact."""
    from collage_tvm.backends.dnnl import DnnlBf16Lowering
    from collage_tvm.precision import relative_error

    if kind == "conv2d_bias_add_relu":
        x, r, w, b = _rand(1, 16, 12, 12), _rand(1, 16, 12, 12), _rand(16, 16, 3, 3), _rand(16)
        f = _func([x.shape, r.shape], lambda bb, p, res: op.nn.relu(bb.emit(op.add(bb.emit(op.add(
            bb.emit(op.nn.conv2d(p, relax.const(w), padding=1)),
            relax.const(b.reshape(1, 16, 1, 1)))), res))))
        args, want = (x, r), F.relu(F.conv2d(T(x), T(w), T(b), padding=1) + T(r))
    elif kind == "dense_bias_gelu":
        x, w, b = _rand(8, 64), _rand(64, 32), _rand(32)
        f = _func([x.shape], lambda bb, p: op.nn.gelu(bb.emit(op.add(
            bb.emit(op.matmul(p, relax.const(w))), relax.const(b)))))
        args, want = (x,), F.gelu(T(x) @ T(w) + T(b))
    else:
        a, bmat, b = _rand(7, 64), _rand(64, 9), _rand(9)
        f = _func([a.shape, bmat.shape], lambda bb, p, q: op.add(bb.emit(op.matmul(p, q)),
                                                               relax.const(b)))
        args, want = (a, bmat), T(a) @ T(bmat) + T(b)
    out = DnnlBf16Lowering().lower(f)(*[tvm.runtime.tensor(a) for a in args])
    assert out.dtype == "float32"
    err = relative_error([out.numpy()], [want.numpy()])
    assert 1e-5 < err < 2e-2, err
    assert relative_error([_call(f, *args)], [want.numpy()]) < 1e-5
    assert DnnlBf16Lowering().version().endswith("-bf16")
