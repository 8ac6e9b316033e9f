"""The model zoo: every small model goes ONNX -> Relax -> TVM build -> VM and matches PyTorch."""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from collage_tvm.tools import zoo
from collage_tvm.frontend import load_model, normalize_for_collage
from collage_tvm.target import make_target

PAPER_MODELS = ["bert", "dcgan", "nasnet", "resnet3d", "resnext50", "resnet50", "inception_v3",
                "squeezenet"]


def test_zoo_names():
    assert zoo.names() == PAPER_MODELS
    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo.get("nope")
    with pytest.raises(ValueError, match="unknown size"):
        zoo.get("dcgan", "huge")


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_small_model_tvm_matches_torch(name, tmp_path):
    model, x = zoo.get(name, "small")
    assert tuple(x.shape) == zoo.SHAPES[name]["small"]
    assert not model.training
    with torch.no_grad():
        ref = model(x).numpy()
    assert np.isfinite(ref).all() and np.abs(ref).max() > 1e-3  # not a trivially-zero output
    path = zoo.export_onnx(name, "small", str(tmp_path / f"{name}.onnx"))
    mod = normalize_for_collage(load_model(path))
    ex = tvm.compile(mod, make_target("llvm"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x.numpy()))
    out = out if hasattr(out, "numpy") else out[0]
    got = out.numpy()
    assert got.shape == ref.shape
    assert np.allclose(got, ref, rtol=1e-3, atol=1e-3), np.abs(got - ref).max()


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_paper_size_constructs(name):
    model, x = zoo.get(name, "paper")
    assert isinstance(model, torch.nn.Module) and not model.training
    assert tuple(x.shape) == zoo.SHAPES[name]["paper"]
    if name == "bert":
        assert x.dtype == torch.int64
