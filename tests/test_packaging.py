"""The wheel ships the whole package: every module of the source tree, at its installed path,
and a wheel installed outside the source tree runs Collage over the graph libraries (whose
patterns and lowerings need ``collage_tvm.export``).

The wheel is built from a copy of the tree in a temporary folder: an in-tree build would
write ``build/`` and ``*.egg-info`` into the working tree, and setuptools' ``build/lib``
keeps modules deleted from the tree, which would then ship.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Source folder -> where its modules install (setup.py's packages).
INSTALLED_AS = {"collage_tvm": "collage_tvm"}

# What a checkout may hold that is no part of a build.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", "out", "bench-out*", "*.db", "*.db-*")


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The path of the wheel ``pip wheel`` builds from (a copy of) this source tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    dist = tmp / "dist"
    res = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "-q", "-w", str(dist), str(src)], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = dist.glob("collage_tvm-*.whl")
    return path


def test_wheel_holds_every_module_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in z.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    expected = {f"{INSTALLED_AS[folder]}/{path.relative_to(ROOT / folder).as_posix()}"
                for folder in INSTALLED_AS
                for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}
    assert "collage_tvm/export/onnx.py" in expected and "collage_tvm/tools/zoo.py" in expected
    # the built-in backends: each one's lowering and pattern file
    assert {"collage_tvm/backends/onnxruntime/__init__.py",
            "collage_tvm/backends/onnxruntime/patterns.py",
            "collage_tvm/backends/tvm/patterns.py"} <= expected
    assert sorted(expected - names) == []
    # matplotlib only with the plot extra
    plot = [r for r in requires if "matplotlib" in r]
    assert plot and all("extra ==" in r and "plot" in r for r in plot), requires


def _tiny_onnx(path: Path) -> Path:
    """conv -> relu -> 1x1 conv -> add -> relu on a 1x3x16x16 image (opset 17, IR 8)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype("float32") * 0.2, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 8, 1, 1)).astype("float32") * 0.2, "w2")
    nodes = [helper.make_node("Conv", ["input", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Add", ["c2", "r1"], ["a"]),
             helper.make_node("Relu", ["a"], ["output"])]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 8, 16, 16])],
        initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime 1.31 reads at most 13; onnx 1.23 writes 14
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.mark.slow
def test_wheel_installed_outside_the_tree_runs_the_graph_libraries(wheel, tmp_path):
    from collage_tvm.measure.db import CostDB

    target = tmp_path / "site"
    res = _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                str(target), str(wheel)], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    work = tmp_path / "work"
    work.mkdir()
    model = _tiny_onnx(work / "model.onnx")
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = _run([sys.executable, "-c",
                  "import importlib.util, collage_tvm, collage_tvm.export, collage_tvm.backends; "
                  "print(collage_tvm.__file__); print(collage_tvm.export.__file__); "
                  "print(collage_tvm.backends.__file__); print(importlib.util.find_spec("
                  "'collage_tvm.backends.onnxruntime.patterns').origin)"],
                 cwd=work, env=env, timeout=300)
    assert where.returncode == 0, where.stderr
    paths = where.stdout.split()
    assert len(paths) == 4 and all(Path(p).resolve().is_relative_to(target.resolve())
                                   for p in paths), (paths, target)
    db = tmp_path / "c.db"
    run = _run([sys.executable, "-m", "collage_tvm.cli", "optimize", str(model), "--backends",
                "tvm,onnxruntime,openvino", "--in-process", "--no-compare", "--calibrate", "0",
                "--refine", "0", "--db", str(db)], cwd=work, env=env, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    for lib in ("onnxruntime", "openvino"):
        assert f"backend {lib} skipped" not in out, out
    # Their candidates reached the measurer: the exporter and their patterns are installed.
    assert {"tvm", "onnxruntime", "openvino"} <= set(CostDB(str(db)).stats()["by_backend"]), out
