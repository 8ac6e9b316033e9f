"""`make demo`: Collage on a bundled model (a small ResNet defined in code, random weights).

Exports it to ONNX as PyTorch's tutorial does, with a dynamic batch axis, and runs
`collage-tvm optimize` with its defaults: the batch range read from the model (1 to 8,
searched at 1), both levels of the search at the optimum over every CPU backend that loads
(TVM, oneDNN, MKL, ONNX Runtime, OpenVINO), the op-level DP over measured candidate costs, a
60-second evolutionary graph-level search, and the final check; then the choice of library
at each batch size, timed side by side. Prints the search's progress, the operators per
backend, the latency of the Collage build next to each single-backend build and to the ONNX
file run whole by ONNX Runtime and OpenVINO, and what serves each batch size. Then saves the
build and runs it back at every batch size (`collage-tvm run --bench`). Run it twice: the
second run reuses the cost DB and the placement log and measures nothing. Extra arguments
go to `collage-tvm optimize` (e.g. `-v`, `--shapes input=1x3x32x32:1x3x32x32:4x3x32x32`).
"""
import os
import sys

from collage_tvm.cli import main
from collage_tvm.frontend.model_file import export_torch
from collage_tvm.tools.zoo import get

out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
os.makedirs(out, exist_ok=True)
model, x = get("resnet_small", "small")
path = export_torch(model, (x,), os.path.join(out, "resnet_small.onnx"), input_names=["input"],
                    output_names=["output"],
                    dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
saved = os.path.join(out, "resnet_small.collage")
code = main(["optimize", path, "--db", os.path.join(out, "collage.db"),
             "-o", os.path.join(out, "placement.json"), "--export", saved] + sys.argv[1:])
if code == 0:
    print(f"\n$ collage-tvm run {saved} --bench 20")
    code = main(["run", saved, "--bench", "20"])
sys.exit(code)
