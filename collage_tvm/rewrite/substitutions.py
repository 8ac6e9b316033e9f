"""The substitutions collage-tvm ships, each with its z3 statement and its numeric check.

A ``Substitution`` has
- ``statement()``: (source, target, assumptions) as z3 terms over ``verify``'s operators;
  ``verify.prove`` must find it unsat (source == target follows from the axioms);
- ``cases``: attribute cases (stride, padding, groups, ...) for the numeric check;
- ``relax(case)``: (source, target) as Relax functions of the same inputs, compiled and run
  on random inputs by ``numeric.check``. Where the rewrite is implemented as a pass
  (``passes.fold_conv_affine``, ``passes.merge_sibling_convs``), the target is what the
  pass makes of the source, so the check covers the implementation, not a second
  hand-written copy of it.

``WRONG`` holds substitutions that must fail: the tests show each one is caught.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import z3

from . import verify as V


@dataclass(frozen=True)
class Substitution:
    name: str
    doc: str
    statement: object      # () -> (source, target, assumptions)
    relax: object          # (case: dict) -> (source Relax function, target Relax function)
    cases: tuple           # of dicts


def _cases(**axes) -> tuple:
    keys = list(axes)
    return tuple(dict(zip(keys, vals)) for vals in itertools.product(*axes.values()))


# --------------------------------------------------------------------------- fold affine

def fold_statement(shift_in_target: bool = True):
    """``fold_conv_affine`` stated in z3; ``shift_in_target=False`` forgets the batch norm's
    shift in the folded bias (a wrong fold: the tests show z3 does not prove it)."""
    bias, mean, inv_std, gamma, beta = z3.Reals("bias mean inv_std gamma beta")
    conv = V.conv2d(V.st, V.pd, V.g, V.x, V.w)
    # conv + bias, - mean, * 1/std (a divide), * gamma, + beta: batch norm decomposed for
    # inference after a convolution with bias
    source = V.chadd(V.chmul(V.chmul(V.chadd(V.chadd(conv, bias), -mean), inv_std), gamma),
                     beta)
    scale = inv_std * gamma
    target = V.chadd(V.conv2d(V.st, V.pd, V.g, V.x, V.wscale(V.w, scale)),
                     (bias - mean) * scale + (beta if shift_in_target else 0))
    return source, target, ()


def _fold_relax(case):
    from .passes import fold_conv_affine

    src = _conv_affine_function(case)
    return src, fold_conv_affine(_module(src))["main"]


def _conv_affine_function(case):
    from tvm import relax

    rng = np.random.default_rng(0)
    c_in, c_out, groups = 4, 8, case["groups"]
    xv = relax.Var("x", relax.TensorType((1, c_in, 9, 9), "float32"))
    weight = rng.standard_normal((c_out, c_in // groups, 3, 3)).astype("float32")

    def per_channel(low=-1.0, high=1.0):
        return relax.const(rng.uniform(low, high, (1, c_out, 1, 1)).astype("float32"))

    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            out = bb.emit(relax.op.nn.conv2d(xv, relax.const(weight), strides=case["stride"],
                                             padding=case["padding"], groups=groups))
            out = bb.emit(relax.op.add(out, per_channel()))
            out = bb.emit(relax.op.subtract(out, per_channel()))
            out = bb.emit(relax.op.divide(out, per_channel(0.5, 2.0)))
            out = bb.emit(relax.op.multiply(out, per_channel()))
            out = bb.emit_output(relax.op.add(out, per_channel()))
        bb.emit_func_output(out)
    return bb.get()["main"]


def _module(func):
    import tvm

    return tvm.IRModule({"main": func})


# --------------------------------------------------------------------------- sibling convs

def _merge_statement():
    merged = V.conv2d(V.st, V.pd, 1, V.x, V.concat(0, V.w, V.v))
    source = (V.conv2d(V.st, V.pd, 1, V.x, V.w), V.conv2d(V.st, V.pd, 1, V.x, V.v))
    target = (V.split0(1, merged), V.split1(1, merged))
    return z3.And(source[0] == target[0], source[1] == target[1]), True, ()


def _merge_relax(case):
    from tvm import relax

    from .passes import merge_sibling_convs, sibling_conv_sites

    rng = np.random.default_rng(0)
    kw = dict(strides=case["stride"], padding=case["padding"])
    xv = relax.Var("x", relax.TensorType((1, 3, 9, 9), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.nn.conv2d(xv, relax.const(
                rng.standard_normal((c, 3, 3, 3)).astype("float32")), **kw)) for c in (4, 6)]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    source = bb.get()
    (site,) = sibling_conv_sites(source)
    return source["main"], relax.transform.Normalize()(merge_sibling_convs(source, site))["main"]


# --------------------------------------------------------------------------- sibling matmuls

def _merge_matmul_statement():
    merged = V.matmul(V.x, V.concat(-1, V.w, V.v))
    source = (V.matmul(V.x, V.w), V.matmul(V.x, V.v))
    target = (V.split0(-1, merged), V.split1(-1, merged))
    return z3.And(source[0] == target[0], source[1] == target[1]), True, ()


def _merge_matmul_relax(case):
    from tvm import relax

    from .passes import merge_sibling_matmuls, sibling_matmul_sites

    rng = np.random.default_rng(0)
    xv = relax.Var("x", relax.TensorType(case["input"], "float32"))
    k = case["input"][-1]
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.matmul(xv, relax.const(
                rng.standard_normal((k, n)).astype("float32")))) for n in (4, 6)]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    source = bb.get()
    (site,) = sibling_matmul_sites(source)
    return source["main"], relax.transform.Normalize()(merge_sibling_matmuls(source, site))["main"]


# --------------------------------------------------------------------------- conv of a concat

def _concat_conv_statement():
    weight = V.concat(1, V.w, V.v)  # any kernel is its input channels' parts stacked
    source = V.conv2d(V.st, V.pd, 1, V.concat(1, V.x, V.y), weight)
    target = V.add(V.conv2d(V.st, V.pd, 1, V.x, V.split0(1, weight)),
                   V.conv2d(V.st, V.pd, 1, V.y, V.split1(1, weight)))
    return source, target, ()


def _concat_conv_relax(case):
    from tvm import relax

    from .passes import concat_conv_sites, split_conv_over_concat

    rng = np.random.default_rng(0)
    channels = (2, 3, 4)[:case["parts"]]
    xs = [relax.Var(f"x{k}", relax.TensorType((1, c, 9, 9), "float32"))
          for k, c in enumerate(channels)]
    weight = rng.standard_normal((5, sum(channels), 3, 3)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", xs):
        with bb.dataflow():
            cat = bb.emit(relax.op.concat(xs, axis=1))
            out = bb.emit_output(relax.op.nn.conv2d(cat, relax.const(weight),
                                                    strides=case["stride"],
                                                    padding=case["padding"]))
        bb.emit_func_output(out)
    source = bb.get()
    (site,) = concat_conv_sites(source)
    return source["main"], relax.transform.Normalize()(
        split_conv_over_concat(source, site))["main"]


# --------------------------------------------------------------------------- avg pool

def _pool_statement(count_include_pad: int):
    def statement():
        source = V.avg_pool2d(V.k, V.st, V.pd, count_include_pad, V.x)
        target = V.conv2d(V.st, V.pd, V.channels(V.x), V.x, V.depthwise_pool_weight(V.k))
        return source, target, ()
    return statement


def _pool_relax(count_include_pad: bool):
    def build(case):
        from tvm import relax

        k, channels = case["kernel"], 3
        funcs = []
        for as_conv in (False, True):
            xv = relax.Var("x", relax.TensorType((1, channels, 8, 8), "float32"))
            bb = relax.BlockBuilder()
            with bb.function("main", [xv]):
                with bb.dataflow():
                    if as_conv:
                        weight = np.full((channels, 1, k, k), 1.0 / (k * k), "float32")
                        out = relax.op.nn.conv2d(xv, relax.const(weight),
                                                 strides=case["stride"],
                                                 padding=case["padding"], groups=channels)
                    else:
                        out = relax.op.nn.avg_pool2d(
                            xv, k, strides=case["stride"], padding=case["padding"],
                            count_include_pad=count_include_pad)
                    out = bb.emit_output(out)
                bb.emit_func_output(out)
            funcs.append(bb.get()["main"])
        return tuple(funcs)
    return build


SUBSTITUTIONS = (
    Substitution(
        "fold_conv_affine",
        "a convolution followed by per-channel adds, subtracts, multiplies and divides by "
        "constants (a bias and a batch norm decomposed for inference) becomes one "
        "convolution with scaled weights and one bias add",
        fold_statement, _fold_relax,
        _cases(stride=(1, 2), padding=(0, 1), groups=(1, 2))),
    Substitution(
        "merge_sibling_convs",
        "two convolutions of one input with the same stride and padding become one "
        "convolution over their stacked kernels, split along the channels",
        _merge_statement, _merge_relax, _cases(stride=(1, 2), padding=(0, 1))),
    Substitution(
        "merge_sibling_matmuls",
        "two matmuls of one input by constant weights of one row count become one matmul by "
        "the weights side by side, split along the last axis (a transformer's Q, K, V)",
        _merge_matmul_statement, _merge_matmul_relax,
        _cases(input=((5, 8), (1, 16), (1, 3, 8), (2, 2, 3, 8)))),
    Substitution(
        "split_conv_over_concat",
        "a convolution over a channel concat becomes the sum of one convolution per part, "
        "each over that part's input channels of the kernel",
        _concat_conv_statement, _concat_conv_relax,
        _cases(stride=(1, 2), padding=(0, 1), parts=(2, 3))),
    Substitution(
        "avg_pool_as_depthwise_conv",
        "average pooling that counts the padding is a depthwise convolution with a constant "
        "1/k^2 kernel",
        _pool_statement(1), _pool_relax(True),
        _cases(kernel=(2, 3), stride=(1, 2), padding=(0, 1))),
)

WRONG = (
    Substitution(
        "avg_pool_excluding_pad_as_depthwise_conv",
        "WRONG: with count_include_pad=False the border windows divide by fewer elements",
        _pool_statement(0), _pool_relax(False),
        _cases(kernel=(3,), stride=(1,), padding=(1,))),
)


def by_name(name: str) -> Substitution:
    for sub in SUBSTITUTIONS + WRONG:
        if sub.name == name:
            return sub
    raise KeyError(f"no substitution {name!r}: one of "
                   f"{', '.join(s.name for s in SUBSTITUTIONS + WRONG)}")


def prove(sub: Substitution) -> V.Proof:
    source, target, assumptions = sub.statement()
    return V.prove(sub.name, source, target, assumptions)
