"""Substitutions proved with z3 from operator axioms (TASO, SOSP'19, section 2.4).

Tensors are an uninterpreted sort; every operator is an uninterpreted function whose
integer parameters (stride, padding, axis, ...) come first. What we know of the operators is
stated as axioms (universally quantified equalities). A substitution ``source -> target`` is
proved when z3 finds no model of the axioms in which ``source != target`` (unsat).

Per-channel constants (a bias, a batch norm's mean, scale, shift) are z3 reals: the
operators apply them channel by channel, each channel independently, so one real stands for
the channel's value and real arithmetic does the rest (``chadd(y, a)`` adds ``a`` to every
element of channel c of ``y``).

An axiom is a fact about the operators, stated once; it is not checked here. Each one is
checked numerically against TVM in ``numeric.py``'s cases and in the tests, as TASO checks
its axioms on small tensors. What a proof cannot see -- an axiom stated too broadly -- the
numeric check of the substitution does (average pool with ``count_include_pad=False`` is
not a depthwise convolution at the borders).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import z3

T = z3.DeclareSort("Tensor")
Int, Real = z3.IntSort(), z3.RealSort()


def _fn(name, *params):
    return z3.Function(name, *params)


# Operators. Integer parameters first (TASO's convention), tensors after.
conv2d = _fn("conv2d", Int, Int, Int, T, T, T)          # stride, padding, groups, data, weight
depthwise_pool_weight = _fn("pool_weight", Int, T)      # k: the k x k kernel of 1/k^2 per channel
avg_pool2d = _fn("avg_pool2d", Int, Int, Int, Int, T, T)  # kernel, stride, padding,
#                                                           count_include_pad, data
concat = _fn("concat", Int, T, T, T)                    # axis, a, b
split0 = _fn("split0", Int, T, T)                       # first part of a split at the size of
split1 = _fn("split1", Int, T, T)                       # ... the first operand it was made of
relu = _fn("relu", T, T)
add = _fn("add", T, T, T)
mul = _fn("mul", T, T, T)                               # elementwise
matmul = _fn("matmul", T, T, T)
transpose = _fn("transpose", T, T)
chadd = _fn("chadd", T, Real, T)                        # + a per channel
chmul = _fn("chmul", T, Real, T)                        # * a per channel
wscale = _fn("wscale", T, Real, T)                      # a kernel's output channel times a
channels = _fn("channels", T, Int)                      # number of channels (axis 1)

x, y, z, w, v = z3.Consts("x y z w v", T)
a, b, s = z3.Reals("a b s")
st, pd, g, ax, k = z3.Ints("st pd g ax k")


def _axioms() -> dict:
    """name -> the axiom (one fact about the operators each)."""
    return {
        # elementwise algebra
        "add commutes": z3.ForAll([x, y], add(x, y) == add(y, x)),
        "add associates": z3.ForAll([x, y, z], add(x, add(y, z)) == add(add(x, y), z)),
        "mul commutes": z3.ForAll([x, y], mul(x, y) == mul(y, x)),
        "mul associates": z3.ForAll([x, y, z], mul(x, mul(y, z)) == mul(mul(x, y), z)),
        "mul distributes over add": z3.ForAll(
            [x, y, z], mul(add(x, y), z) == add(mul(x, z), mul(y, z))),
        "transpose distributes over add": z3.ForAll(
            [x, y], transpose(add(x, y)) == add(transpose(x), transpose(y))),
        "transpose distributes over mul": z3.ForAll(
            [x, y], transpose(mul(x, y)) == mul(transpose(x), transpose(y))),
        "relu commutes with transpose": z3.ForAll([x], relu(transpose(x)) == transpose(relu(x))),
        "matmul associates": z3.ForAll(
            [x, y, z], matmul(x, matmul(y, z)) == matmul(matmul(x, y), z)),
        "matmul distributes over add on the left": z3.ForAll(
            [x, y, z], matmul(add(x, y), z) == add(matmul(x, z), matmul(y, z))),
        # per-channel affine maps compose
        "chadd composes": z3.ForAll([x, a, b], chadd(chadd(x, a), b) == chadd(x, a + b)),
        "chmul composes": z3.ForAll([x, a, b], chmul(chmul(x, a), b) == chmul(x, a * b)),
        "chmul distributes over chadd": z3.ForAll(
            [x, a, s], chmul(chadd(x, a), s) == chadd(chmul(x, s), a * s)),
        "chadd 0 is identity": z3.ForAll([x], chadd(x, 0) == x),
        "chmul 1 is identity": z3.ForAll([x], chmul(x, 1) == x),
        # a per-output-channel scale of a convolution is a scale of its kernel's output
        # channels (any stride, padding, groups: output channel o reads kernel o only)
        "conv output scale is kernel scale": z3.ForAll(
            [st, pd, g, x, w, s], chmul(conv2d(st, pd, g, x, w), s)
            == conv2d(st, pd, g, x, wscale(w, s))),
        # convolutions of one input with kernels stacked along the output channels
        "conv of stacked kernels is stacked convs": z3.ForAll(
            [st, pd, x, w, v], conv2d(st, pd, 1, x, concat(0, w, v))
            == concat(1, conv2d(st, pd, 1, x, w), conv2d(st, pd, 1, x, v))),
        # a matmul by weights side by side (along their last axis, -1 here) is the matmuls
        # side by side
        "matmul by stacked weights is stacked matmuls": z3.ForAll(
            [x, w, v], matmul(x, concat(-1, w, v)) == concat(-1, matmul(x, w), matmul(x, v))),
        # split undoes concat
        "split0 of concat": z3.ForAll([ax, x, y], split0(ax, concat(ax, x, y)) == x),
        "split1 of concat": z3.ForAll([ax, x, y], split1(ax, concat(ax, x, y)) == y),
        # relu is elementwise: it commutes with concat
        "relu commutes with concat": z3.ForAll(
            [ax, x, y], relu(concat(ax, x, y)) == concat(ax, relu(x), relu(y))),
        # conv over a channel concat: each part meets its own input channels of the kernel
        "conv of a channel concat is a sum of convs": z3.ForAll(
            [st, pd, x, y, w, v], conv2d(st, pd, 1, concat(1, x, y), concat(1, w, v))
            == add(conv2d(st, pd, 1, x, w), conv2d(st, pd, 1, y, v))),
        # conv is linear in its input (one kernel)
        "conv distributes over add": z3.ForAll(
            [st, pd, g, x, y, w], conv2d(st, pd, g, add(x, y), w)
            == add(conv2d(st, pd, g, x, w), conv2d(st, pd, g, y, w))),
        # matmul
        "matmul distributes over add": z3.ForAll(
            [x, y, z], matmul(x, add(y, z)) == add(matmul(x, y), matmul(x, z))),
        "transpose of matmul": z3.ForAll(
            [x, y], transpose(matmul(x, y)) == matmul(transpose(y), transpose(x))),
        "transpose is an involution": z3.ForAll([x], transpose(transpose(x)) == x),
        # average pooling that counts the padding is a depthwise convolution with the
        # constant 1/k^2 kernel (groups = channels). Stated for count_include_pad = 1 only.
        "avg pool counting padding is depthwise conv": z3.ForAll(
            [k, st, pd, x], avg_pool2d(k, st, pd, 1, x)
            == conv2d(st, pd, channels(x), x, depthwise_pool_weight(k))),
    }


AXIOMS = _axioms()


@dataclass
class Proof:
    name: str
    proved: bool
    result: str            # "unsat" (proved), "sat" (a counter-model), "unknown"
    seconds: float
    axioms: list = field(default_factory=list)


def prove(name: str, source, target, assumptions=(), timeout_ms: int = 10_000) -> Proof:
    """Prove ``source == target`` from the axioms (and ``assumptions``, facts about the
    free constants, e.g. a nonzero divisor)."""
    import time

    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    for ax_ in AXIOMS.values():
        solver.add(ax_)
    for fact in assumptions:
        solver.add(fact)
    solver.add(source != target)
    t0 = time.perf_counter()
    res = solver.check()
    return Proof(name, res == z3.unsat, str(res), time.perf_counter() - t0)
