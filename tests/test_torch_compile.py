"""``torch.compile(model, backend="collage")`` (issue #36, part 4; collage_tvm.torch_backend):
the entry point, the options, each Dynamo graph placed and built, graph breaks, the eager
fallback with its one warning, and a second process placing from the placement log."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from collage_tvm import torch_backend
from collage_tvm.torch_backend import builds, collage, settings, valid_options

# Small builds: TVM and ONNX Runtime, the op-level search only.
FAST = {"backends": ["tvm", "onnxruntime"], "graph_level": False, "compare": False,
        "progress": False}
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    torch_backend.clear_builds()
    yield
    torch._dynamo.reset()


def options(tmp_path, **more) -> dict:
    return {**FAST, "db": str(tmp_path / "c.db"), **more}


class ConvNet(torch.nn.Module):
    """Two convolutions, a batch norm (its buffers are graph inputs too), two outputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv2(torch.relu(self.bn(self.conv1(x))))
        return y + 1.0, y.mean((2, 3))


class BrokenNet(torch.nn.Module):
    """A graph break between two convolutions: two graphs; a list out of the second."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        torch._dynamo.graph_break()
        z = self.conv2(y)
        return [z, torch.sigmoid(z)]


class SvdNet(torch.nn.Module):
    """A singular value decomposition: neither ONNX (opset 17) nor TVM's importer has it."""

    def forward(self, x):
        return torch.linalg.svd(x)[1] * 2.0


def seeded(cls):
    torch.manual_seed(0)
    m = cls().eval()
    if hasattr(m, "bn"):  # batch-norm statistics that are not the identity
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- registration

def test_backend_is_registered_by_entry_point():
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import _BACKENDS, lookup_backend

    # A collage_tvm.egg-info left in the checkout's root by an older in-tree build shadows
    # the installed metadata wherever the root is on sys.path (pytest's pythonpath = .).
    eps = entry_points(group="torch_dynamo_backends")
    assert "collage" in eps.names, \
        "no torch_dynamo_backends entry point: `make setup` (or `python setup.py egg_info` " \
        "where a stale collage_tvm.egg-info sits in the checkout's root)"
    assert eps["collage"].value == "collage_tvm.torch_backend:collage"
    assert "collage" in torch._dynamo.list_backends()
    assert "collage" in _BACKENDS  # Dynamo's registry found it (before anything imported it)
    assert lookup_backend("collage") is collage


def test_options_map_to_search_options():
    s = settings({"backends": "tvm,onnxruntime", "budget": 5, "graph_level": False,
                  "db": "/tmp/x.db", "check": False})
    assert s.search.backends == ("tvm", "onnxruntime")
    assert s.search.budget == 5 and s.search.graph_level is False
    assert s.db == "/tmp/x.db" and s.check is False
    assert settings(None).search == torch_backend.SearchOptions()
    assert {"graph_level", "budget", "accuracy", "db", "placement_log"} <= set(valid_options())


def test_unknown_option_is_a_clear_error():
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'bugdet'.*valid options: .*budget"):
        settings({"bugdet": 5})
    with pytest.raises(ValueError, match="budget must be > 0"):
        settings({"budget": -1})
    with pytest.raises(ValueError, match="option 'backends'.*nosuchlib"):
        settings({"backends": ["tvm", "nosuchlib"]})
    # through torch.compile: Dynamo wraps the backend's error; the message is kept
    f = torch.compile(seeded(ConvNet), backend="collage", options={"bugdet": 5})
    with pytest.raises(Exception, match=r"unknown option\(s\) 'bugdet'.*graph_level"):
        with torch.no_grad():
            f(torch.randn(1, 3, 16, 16))


def test_tensors_pass_to_tvm_without_copy_when_they_can():
    x = torch.randn(4, 16)
    assert torch.from_dlpack(torch_backend._to_tvm(x)).data_ptr() == x.data_ptr()
    for odd in (x.t(), x.reshape(-1)[1:]):  # strided; misaligned (TVM wants 64 bytes)
        y = torch.from_dlpack(torch_backend._to_tvm(odd))
        assert y.data_ptr() != odd.data_ptr()
        torch.testing.assert_close(y, odd)


# --------------------------------------------------------------------------- builds

def test_conv_model_matches_eager(tmp_path, caplog):
    m = seeded(ConvNet)
    f = torch.compile(m, backend="collage", options=options(tmp_path))
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert_same(f(x), m(x))
        x2 = torch.randn(1, 3, 16, 16)
        assert_same(f(x2), m(x2))  # same shape: the same build, no recompile
    (b,) = builds()
    assert b.built and b.exporter == "onnx", b.fallback
    assert b.inputs == 1 and b.weights == 8  # conv1, bn (4), conv2: baked in as weights
    assert not b.report.placement_from_log
    assert set(b.report.ops_per_backend) <= {"tvm", "onnxruntime"}

    # A weight changed in place after the build: that graph runs eagerly, with one warning.
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="collage_tvm"):
        m.conv1.weight.mul_(2.0)
        assert_same(f(x), m(x))
        assert_same(f(x2), m(x2))
    changed = [r for r in caplog.records if "changed after the build" in r.getMessage()]
    assert len(changed) == 1, caplog.text


def test_graph_break_compiles_both_graphs(tmp_path):
    m = seeded(BrokenNet)
    f = torch.compile(m, backend="collage", options=options(tmp_path))
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        got = f(x)
        assert_same(got, m(x))
        assert isinstance(got, list)
    graphs = builds()
    assert len(graphs) == 2 and all(g.built for g in graphs), [g.fallback for g in graphs]


def test_unsupported_graph_runs_eagerly_with_one_warning(tmp_path, caplog):
    m = SvdNet()
    f = torch.compile(m, backend="collage", options=options(tmp_path))
    x = torch.randn(2, 4, 4)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="collage_tvm"):
        for _ in range(3):
            assert_same(f(x), m(x))
    warned = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "linalg_svd" in warned[0].getMessage()
    (b,) = builds()
    assert not b.built and "linalg_svd" in b.fallback


def test_what_cannot_be_built_falls_back_before_searching(tmp_path, caplog):
    """Autograd, an input mutated in place: eager, each with its reason, and nothing searched
    (no cost DB written). (Dynamic shapes build for a range: test_torch_compile_dynamic.)"""

    class InPlace(torch.nn.Module):
        def forward(self, x):
            x.add_(1.0)
            return x * 2.0

    cases = [
        (seeded(ConvNet), {}, True, "torch.no_grad()"),
        (InPlace(), {}, False, "in place"),
    ]
    x = torch.randn(1, 3, 16, 16)
    for m, kw, grad, reason in cases:
        torch._dynamo.reset()
        torch_backend.clear_builds()
        f = torch.compile(m, backend="collage", options=options(tmp_path), **kw)
        with torch.set_grad_enabled(grad), caplog.at_level(logging.WARNING, logger="collage_tvm"):
            a, b = x.clone(), x.clone()
            got, want = f(a), m(b)
        assert_same(got, want)
        torch.testing.assert_close(a, b)  # the in-place change happened, as in eager
        assert builds() and all(reason in g.fallback for g in builds()), \
            (reason, [g.fallback for g in builds()])
    assert not (tmp_path / "c.db").exists()


# --------------------------------------------------------------------------- a second process

SCRIPT = """
import json, sys, time
import torch
sys.path.insert(0, {here!r})
import test_torch_compile as t
from collage_tvm.torch_backend import builds

m = t.seeded(t.{model})
x = {inputs}
f = torch.compile(m, backend="collage", options={options!r})
start = time.perf_counter()
with torch.no_grad():
    got = f(*x)
    seconds = time.perf_counter() - start
    t.assert_same(got, m(*x))
print("RESULT", json.dumps({{"seconds": seconds, "graphs": [
    {{"built": b.built, "from_log": bool(b.report and b.report.placement_from_log),
      "seconds": b.seconds, "fallback": b.fallback}} for b in builds()]}}))
"""


def compile_in_fresh_process(tmp_path, model: str, inputs: str, opts: dict) -> dict:
    script = tmp_path / f"compile_{model}.py"
    script.write_text(textwrap.dedent(SCRIPT.format(here=HERE, model=model, inputs=inputs,
                                                    options=opts)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def test_second_process_places_from_the_log(tmp_path):
    opts = options(tmp_path)
    m = seeded(ConvNet)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert_same(torch.compile(m, backend="collage", options=opts)(x), m(x))
    (first,) = builds()
    assert first.built and not first.report.placement_from_log
    second = compile_in_fresh_process(tmp_path, "ConvNet", "(torch.randn(1, 3, 16, 16),)", opts)
    (graph,) = second["graphs"]
    assert graph["built"] and graph["from_log"], graph
    print(f"\nConvNet: first compile {first.seconds:.1f} s, second process "
          f"{graph['seconds']:.1f} s (placement from the log)")


# --------------------------------------------------------------------------- real models

class ResNet18(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from collage_tvm._torchvision import import_torchvision

        self.net = import_torchvision().models.resnet18(weights=None)

    def forward(self, x):
        return self.net(x)


class BertWithBreak(torch.nn.Module):
    """A two-layer BERT encoder from a config (random weights), a graph break after it."""

    def __init__(self):
        super().__init__()
        from collage_tvm._torchvision import import_torchvision

        import_torchvision()  # transformers imports torchvision (collage_tvm._torchvision)
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=64)
        self.bert = BertModel(cfg)

    def forward(self, ids, mask):
        h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        torch._dynamo.graph_break()
        return torch.tanh(h[:, 0]), h.mean(1)


def _real_model(tmp_path, model: str, inputs: str, n_graphs: int):
    opts = options(tmp_path)
    m = seeded(globals()[model])
    x = eval(inputs)
    with torch.no_grad():
        assert_same(torch.compile(m, backend="collage", options=opts)(*x), m(*x))
    first = builds()
    assert len(first) == n_graphs and all(g.built for g in first), [g.fallback for g in first]
    second = compile_in_fresh_process(tmp_path, model, inputs, opts)
    assert len(second["graphs"]) == n_graphs
    assert all(g["built"] and g["from_log"] for g in second["graphs"]), second
    print(f"\n{model}: first compile {sum(g.seconds for g in first):.1f} s, second process "
          f"{sum(g['seconds'] for g in second['graphs']):.1f} s (placement from the log; its "
          f"first call, Dynamo's tracing included: {second['seconds']:.1f} s)")


@pytest.mark.slow
def test_torchvision_resnet18(tmp_path):
    _real_model(tmp_path, "ResNet18", "(torch.randn(1, 3, 64, 64),)", 1)


@pytest.mark.slow
def test_transformers_bert_with_graph_break(tmp_path):
    _real_model(tmp_path, "BertWithBreak", "(torch.randint(0, 100, (2, 16)), "
                "torch.ones(2, 16, dtype=torch.long))", 2)
