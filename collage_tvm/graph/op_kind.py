"""Operator kinds for TVM's fusion rule. Relax ops carry no TOpPattern, so we keep a table.

The kinds and their order follow TVM's ``OpPatternKind`` (include/tvm/relay/op_attr_types.h
before v0.20): a smaller kind fuses more freely.
"""
ELEMWISE, BROADCAST, INJECTIVE, COMM_REDUCE, OUT_EWISE_FUSABLE, TUPLE, OPAQUE = 0, 1, 2, 3, 4, 7, 8

KIND_NAMES = {ELEMWISE: "elemwise", BROADCAST: "broadcast", INJECTIVE: "injective",
              COMM_REDUCE: "reduce", OUT_EWISE_FUSABLE: "out-elemwise-fusable", TUPLE: "tuple",
              OPAQUE: "opaque"}

_ELEMWISE = """abs acos acosh asin asinh atan atanh ceil cos cosh exp floor log negative round
rsqrt sigmoid sign sin sinh sqrt square tan tanh erf clip astype isfinite isinf isnan
logical_not bitwise_not nn.relu nn.gelu nn.gelu_tanh nn.silu nn.leakyrelu nn.selu nn.softplus
nn.prelu nn.relu6 trunc""".split()
_BROADCAST = """add subtract multiply divide floor_divide power maximum minimum mod floor_mod
equal not_equal less less_equal greater greater_equal logical_and logical_or logical_xor
bitwise_and bitwise_or bitwise_xor where""".split()
_INJECTIVE = """reshape permute_dims transpose concat split strided_slice take expand_dims squeeze
flatten broadcast_to repeat tile flip zeros_like ones_like full_like layout_transform
dynamic_strided_slice gather_elements gather_nd one_hot nn.pad collapse_sum_to""".split()
_REDUCE = "sum mean max min prod variance std argmax argmin".split()
_OUT_EWISE = """nn.conv1d nn.conv2d nn.conv3d nn.conv1d_transpose nn.conv2d_transpose
nn.conv3d_transpose matmul linear nn.max_pool1d nn.max_pool2d nn.max_pool3d nn.avg_pool1d
nn.avg_pool2d nn.avg_pool3d nn.adaptive_avg_pool1d nn.adaptive_avg_pool2d
nn.adaptive_avg_pool3d""".split()
# Softmax, norms, attention etc. lower to several reductions: TVM keeps them alone.
_OPAQUE = """nn.softmax nn.log_softmax nn.layer_norm nn.batch_norm nn.group_norm nn.rms_norm
nn.attention cumsum sort argsort topk""".split()

OP_KIND: dict[str, int] = {}
for _names, _kind in ((_ELEMWISE, ELEMWISE), (_BROADCAST, BROADCAST), (_INJECTIVE, INJECTIVE),
                      (_REDUCE, COMM_REDUCE), (_OUT_EWISE, OUT_EWISE_FUSABLE), (_OPAQUE, OPAQUE)):
    for _n in _names:
        OP_KIND["relax." + _n] = _kind


def op_kind(op_name: str) -> int:
    """Kind of a Relax op by name (``"relax.nn.conv2d"``); unknown ops are opaque."""
    return OP_KIND.get(op_name, OPAQUE)
