"""`make demo`: Collage on a bundled model (a small ResNet defined in code, random weights).

Exports it to ONNX and runs `collage-tvm optimize` with its defaults: both levels of the
search over every CPU backend that loads (TVM, oneDNN, MKL, ONNX Runtime, OpenVINO), the
op-level DP over measured candidate costs, then a 60-second evolutionary graph-level search,
and the final check. Prints the search's progress, the operators per backend and the latency
of the Collage build next to each single-backend build and to the ONNX file run whole by
ONNX Runtime and OpenVINO, and ships the fastest. Run it twice: the second run reuses the cost DB and the placement log and
measures nothing. Extra arguments go to `collage-tvm optimize` (e.g. `-v`).
"""
import os
import sys

from collage_tvm.cli import main
from collage_tvm.tools.zoo import export_onnx

out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
model = export_onnx("resnet_small", os.path.join(out, "resnet_small.onnx"))
sys.exit(main(["optimize", model, "--db", os.path.join(out, "collage.db"),
               "-o", os.path.join(out, "placement.json")] + sys.argv[1:]))
