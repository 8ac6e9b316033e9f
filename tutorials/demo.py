"""`make demo`: Collage on a bundled model (a small ResNet defined in code, random weights).

Exports it to ONNX, searches a placement over TVM and oneDNN, prints the operators per
backend and the Collage build's latency next to the single-backend builds. Run it twice:
the second run reuses the cost DB and the placement log, and measures nothing.
"""
import os
import sys

from collage_tvm.cli import main
from collage_tvm.models import export_onnx

out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
model = export_onnx("resnet_small", os.path.join(out, "resnet_small.onnx"))
sys.exit(main(["optimize", model, "--backends", "tvm,dnnl", "--db", os.path.join(out, "collage.db"),
               "-o", os.path.join(out, "placement.json")] + sys.argv[1:]))
