"""What a candidate must cost at least, before it is measured (issue #35, "measure less").

Each candidate's work is counted from its shapes: floating-point operations (a convolution's
or a matrix product's multiply-adds; one per output element elsewhere) and the bytes it must
move (its inputs from outside the group, its weights, its outputs). A backend's *observed
peaks* are the highest rates its measured candidates reached on this machine (FLOP/ms and
bytes/ms, each over the candidates that searched measured or found in the cost DB). The
candidate's *lower bound* is the roofline of those peaks, ``max(flops / peak_flops, bytes /
peak_bytes)``, times ``SLACK``: a candidate cannot run faster than the fastest rate its
backend has shown, with room for what the count misses.

``placer.lean`` uses the lower bounds as the unmeasured candidates' costs in the op-level DP and
measures only the candidates the DP then chooses, until it chooses measured ones only.
"""
from __future__ import annotations

import math
from collections import defaultdict

from tvm import relax

from ..graph.subgraph import Constant

# The share of the roofline a lower bound keeps: a candidate is assumed able to beat its backend's
# best observed rate by up to 1/SLACK (a count that misses work, a kernel better than any yet
# measured).
SLACK = 0.5
# Operators that move no data on a backend that sees them fused (a view, a shape): no lower bound.
FREE = {"relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten",
        "tuple", "tuple_get_item", "relax.shape_of"}
# Operators whose work is multiply-adds: 2 FLOPs per output element per reduced element.
_REDUCING = {"relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d"}
_TRANSPOSED = {"relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose",
               "relax.nn.conv3d_transpose"}
# Operators whose own work a library cannot fuse away: a group's time is at least a share of
# what they take alone on the same backend (``placer.lean``'s parts bound). Elementwise
# operators are not among them: fused into a convolution they cost next to nothing.
HEAVY = _REDUCING | _TRANSPOSED | {
    "relax.matmul", "relax.nn.linear", "relax.nn.max_pool1d", "relax.nn.max_pool2d",
    "relax.nn.max_pool3d", "relax.nn.avg_pool1d", "relax.nn.avg_pool2d", "relax.nn.avg_pool3d",
    "relax.nn.adaptive_avg_pool1d", "relax.nn.adaptive_avg_pool2d",
    "relax.nn.adaptive_avg_pool3d", "relax.mean", "relax.sum"}


def _shape(sinfo) -> list | None:
    shape = getattr(sinfo, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    try:
        return [int(d) for d in shape.values]
    except (TypeError, ValueError):  # a symbolic dimension
        return None


def _elements(sinfo) -> int:
    """Elements of a tensor (the sum over a tuple's fields); 0 where unknown."""
    if isinstance(sinfo, relax.TupleType):
        return sum(_elements(f) for f in sinfo.fields)
    shape = _shape(sinfo)
    return math.prod(shape) if shape is not None else 0


def _bytes(sinfo) -> int:
    if isinstance(sinfo, relax.TupleType):
        return sum(_bytes(f) for f in sinfo.fields)
    return _elements(sinfo) * _width(str(getattr(sinfo, "dtype", "") or "float32"))


def _width(dtype: str) -> int:
    """Bytes of one element of ``dtype`` ("float32": 4, "bool": 1; unknown: 4)."""
    digits = "".join(ch for ch in dtype.split("x")[0] if ch.isdigit())
    return max(1, int(digits) // 8) if digits else (1 if dtype == "bool" else 4)


def node_flops(node) -> int:
    """Floating-point operations of one dataflow-graph node (see the module docstring)."""
    call = node.call
    if call is None or node.op_name in FREE:
        return 0
    out = _elements(call.ty)
    args = [a.ty for a in call.args if isinstance(a, relax.Expr)]
    if node.op_name in _REDUCING and len(args) > 1:
        w = _shape(args[1])
        return 2 * out * math.prod(w[1:]) if w else out
    if node.op_name in _TRANSPOSED and len(args) > 1:
        w = _shape(args[1])
        return 2 * _elements(args[0]) * math.prod(w[1:]) if w else out
    if node.op_name in ("relax.matmul", "relax.nn.linear") and args:
        a = _shape(args[0])
        return 2 * out * a[-1] if a else out
    if node.op_name.startswith("relax.nn.") and "pool" in node.op_name or \
            node.op_name in ("relax.sum", "relax.mean", "relax.max", "relax.min", "relax.prod",
                             "relax.variance", "relax.nn.layer_norm", "relax.nn.batch_norm",
                             "relax.nn.softmax", "relax.nn.group_norm"):
        return max(out, max((_elements(a) for a in args), default=0))
    return out


def node_bytes(node) -> tuple:
    """(output bytes, weight bytes) of one node."""
    call = node.call
    if call is None:
        return 0, 0
    weights = sum(_bytes(a.ty) for a in call.args if isinstance(a, Constant))
    return _bytes(call.ty), weights


def work(graph, nodes) -> tuple:
    """(FLOPs, bytes) of the group ``nodes`` of ``graph``: bytes are the tensors read from
    outside the group (the model's inputs included), its weights, and the outputs read
    outside it (or the model's)."""
    nodes = set(nodes)
    flops = moved = 0
    outputs = set(graph.outputs)
    for i in nodes:
        node = graph.nodes[i]
        if node.op_name in FREE:
            continue
        flops += node_flops(node)
        out, weights = node_bytes(node)
        moved += weights
        if i in outputs or any(u not in nodes for u in node.users):
            moved += out
        for j in node.inputs:
            if j not in nodes:
                moved += node_bytes(graph.nodes[j])[0]
        call = node.call
        if call is not None:  # the function's own parameters (the model's inputs)
            moved += sum(_bytes(a.ty) for a in call.args
                         if isinstance(a, relax.Var) and a in graph.params)
    return flops, moved


class Roofline:
    """Each backend's observed peaks, and the lower bounds they give (module docstring)."""

    def __init__(self, slack: float = SLACK):
        self.slack = slack
        self.peak_flops: dict = defaultdict(float)  # backend -> FLOP per ms
        self.peak_bytes: dict = defaultdict(float)  # backend -> bytes per ms
        self.seen: dict = defaultdict(int)

    def observe(self, backend: str, flops: int, moved: int, ms: float) -> None:
        """A measured candidate of ``backend`` doing (``flops``, ``moved``) in ``ms`` (its
        time without its call overhead)."""
        if not (math.isfinite(ms) and ms > 1e-6):
            return
        self.seen[backend] += 1
        self.peak_flops[backend] = max(self.peak_flops[backend], flops / ms)
        self.peak_bytes[backend] = max(self.peak_bytes[backend], moved / ms)

    def bound(self, backend: str, flops: int, moved: int) -> float:
        """The least ``backend`` could take (ms, its call overhead excluded); 0 before any of
        its candidates was measured (the DP then tries it, and it is measured)."""
        pf, pb = self.peak_flops.get(backend, 0.0), self.peak_bytes.get(backend, 0.0)
        at_peak = max(flops / pf if pf > 0 else 0.0, moved / pb if pb > 0 else 0.0)
        return self.slack * at_peak
