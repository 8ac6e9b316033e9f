"""``torch.compile(model, backend="collage")`` on graphs with symbolic sizes (issue #77, part
4; collage_tvm.torch_backend): ``dynamic=True`` and Dynamo's automatic dynamic shapes build
once for a range of shapes (``collage_tvm.dynamic``), a call outside it runs eagerly, and a
size the build cannot recompute leaves the graph eager before anything is searched."""
from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch

from collage_tvm import torch_backend
from collage_tvm.torch_backend import builds
# (_fresh: test_torch_compile's autouse fixture, active here by the import)
from test_torch_compile import _fresh, ConvNet, assert_same, options, seeded  # noqa: F401


class FlatMLP(torch.nn.Module):
    """A batch of 4x8 inputs flattened by their own batch size (``reshape(x.shape[0], -1)``:
    the graph reads the size Dynamo passes as a SymInt input), two linears, a softmax."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.reshape(x.shape[0], -1)))).softmax(-1)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Scaled(torch.nn.Module):
    """An int argument: under ``dynamic=True`` a SymInt that is no size of a tensor."""

    def forward(self, x, n):
        return torch.relu(x) * n


def close(got, want):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


def eager_warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]


# --------------------------------------------------------------------------- builds

def test_dynamic_true_builds_once_for_a_range(tmp_path, caplog):
    m = seeded(FlatMLP)
    f = torch.compile(m, backend="collage", dynamic=True, options=options(tmp_path))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="collage_tvm"):
        for batch in (2, 3, 5, 8):
            x = torch.randn(batch, 4, 8)
            close(f(x), m(x))
    assert not eager_warnings(caplog), caplog.text
    (b,) = builds()  # one build for every batch size, not one per shape
    assert b.built and b.exporter == "onnx", b.fallback
    assert b.inputs == 1 and b.weights == 4  # the SymInt batch size is no input of the build
    # the batch from Dynamo's least (2) to the default 8, at the example's size; the 4 and
    # 8 a guard ties together (Eq(s27*s53, 32): the reshape to 32) at their own size alone
    assert "2..8 (opt 2)" in b.shapes and "4..4" in b.shapes and "8..8" in b.shapes, b.shapes
    (spec,) = b.report.dynamic["ranges"]["inputs"]  # the ONNX file's dim_params, one each
    assert len(spec["dims"]) == 3 and all(isinstance(d, str) for d in spec["dims"]), spec


def test_a_call_outside_the_range_runs_eagerly(tmp_path, caplog):
    """The user's range (``options={"shapes": ...}``, by the argument's name) wins over the
    default; a call outside it runs the graph eagerly, correct, with one warning."""
    m = seeded(MLP)
    f = torch.compile(m, backend="collage", dynamic=True,
                      options=options(tmp_path, shapes={"x": "2x8:3x8:4x8"}))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="collage_tvm"):
        for batch in (3, 2, 4):
            x = torch.randn(batch, 8)
            close(f(x), m(x))
        assert not eager_warnings(caplog), caplog.text
        for batch in (6, 7, 3):  # outside (twice: one warning), then inside again
            x = torch.randn(batch, 8)
            close(f(x), m(x))
    (b,) = builds()
    assert b.built and b.shapes.endswith(" 2..4 (opt 3)"), (b.fallback, b.shapes)
    (warned,) = eager_warnings(caplog)
    assert "6x8" in warned and "outside the range" in warned, warned


def test_automatic_dynamic_recompile_is_built_for_a_range(tmp_path):
    """No dynamic flag: the first shape gets a static build; the second makes Dynamo
    recompile with a symbolic batch, and that graph is built once for a range."""
    m = seeded(MLP)
    f = torch.compile(m, backend="collage", options=options(tmp_path))
    with torch.no_grad():
        for batch in (2, 3, 5, 7):
            x = torch.randn(batch, 8)
            close(f(x), m(x))
    static, symbolic = builds()
    assert static.built and not static.shapes, static.fallback
    assert symbolic.built and "2..8 (opt 3)" in symbolic.shapes, (symbolic.fallback,
                                                                   symbolic.shapes)


def test_conv_net_dynamic_batch(tmp_path):
    """Batch norm's eps and momentum (Python floats Dynamo passes as 0-d tensors under
    dynamic=True) are baked in; an image's spatial size is built at the example's alone."""
    m = seeded(ConvNet)
    f = torch.compile(m, backend="collage", dynamic=True, options=options(tmp_path))
    with torch.no_grad():
        for batch in (2, 4):
            x = torch.randn(batch, 3, 16, 16)
            assert_same(f(x), m(x))
        x = torch.randn(2, 3, 12, 12)  # another image size: eagerly
        assert_same(f(x), m(x))
    (b,) = builds()
    assert b.built and b.inputs == 1, b.fallback
    assert "16..16" in b.shapes, b.shapes


def test_a_size_that_is_no_dimension_runs_eagerly_before_searching(tmp_path, caplog):
    m = Scaled()
    f = torch.compile(m, backend="collage", dynamic=True, options=options(tmp_path))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="collage_tvm"):
        for n in (3, 4):
            x = torch.randn(4, 5)
            close(f(x, n), m(x, n))
    assert builds() and not any(g.built for g in builds())
    assert all("no size of a tensor input" in g.fallback for g in builds()), \
        [g.fallback for g in builds()]
    assert not (tmp_path / "c.db").exists()


# --------------------------------------------------------------------------- the ranges

def test_ranges_from_dynamo_bounds_defaults_guards_and_options(caplog):
    import sympy

    s0, s1, s2, s3 = sympy.symbols("s0 s1 s2 s3", integer=True, positive=True)
    env = types.SimpleNamespace(guards=[types.SimpleNamespace(expr=s0 < 16),
                                        types.SimpleNamespace(expr=sympy.Eq(s3 * s1, 64))])
    plan = torch_backend._Plan(
        names=["l_x_", "l_y_"], dims=[["s0", "s1"], ["s0", 3, "s2", "s2"]],
        hints={"s0": 3, "s1": 20, "s2": 16}, bounds={"s0": (2, 15), "s1": (2, None),
                                                     "s2": (2, None)}, env=env)
    gm = types.SimpleNamespace(code="")
    axes = torch_backend._ranges(gm, plan, ())
    assert axes["s0"] == (2, 3, 15)     # Dynamo's bounds (s0 < 16 is a bound, not a tie)
    assert axes["s1"] == (20, 20, 20)   # tied by a guard to another size: the example's
    assert axes["s2"] == (16, 16, 16)   # an image's spatial axis: the example's size alone
    plan.env = None
    assert torch_backend._ranges(gm, plan, ())["s1"] == (2, 20, 512)  # a sequence's default
    plan.bounds["s0"] = (2, None)
    assert torch_backend._ranges(gm, plan, ())["s0"] == (2, 3, 8)  # a batch's default
    given = (("x", ((2, 4), (3, 30), (6, 100))),)  # by the argument's name (Dynamo: l_x_)
    axes = torch_backend._ranges(gm, plan, given)
    assert axes["s0"] == (2, 3, 6) and axes["s1"] == (4, 30, 100)
    assert torch_backend._shape_specs(plan, axes) == (
        ("l_x_", ((2, 4), (3, 30), (6, 100))),
        ("l_y_", ((2, 3, 16, 16), (3, 3, 16, 16), (6, 3, 16, 16))))
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        torch_backend._ranges(gm, plan, (("z", ((1,), (2,), (3,))),))
    assert "option shapes names z" in caplog.text
    with pytest.raises(torch_backend._Eager, match="min <= opt <= max"):
        torch_backend._ranges(gm, plan, (("x", ((4, 4), (3, 30), (6, 100))),))
