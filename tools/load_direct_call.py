"""Ad hoc (docs/results/load_direct_call_*.json; `python tools/load_direct_call.py MODEL OUT.json`): a saved build that runs the user's file whole, called as a user calls it
(collage_tvm.load(dir)(numpy)) through the library's own call ("direct") and through the
Relax VM (the code before), beside the framework's own call on the same file, interleaved."""
import json, os, sys, time
import numpy as np
os.makedirs("/tmp/dc", exist_ok=True)
import collage_tvm
from collage_tvm.measure.timing import interleaved
from collage_tvm.tools import bench, suites

name, out = sys.argv[1], sys.argv[2]
if name in suites.TRANSFORMERS:
    model, inputs = suites.transformers_model(name, "usual")
else:
    model, inputs = suites.torchvision_model(name, "usual")
path = f"/tmp/dc/{name}.onnx"
suites.export_either(model, inputs, path)
arrays = [np.ascontiguousarray(i.numpy()) for i in inputs]
t = time.time()
res = collage_tvm.optimize(path, "llvm", db=f"/tmp/dc/{name}.db", progress=False)
search_s = time.time() - t
art = collage_tvm.save(res, f"/tmp/dc/{name}_art")
shipped = res.report.shipped
del res
mod = collage_tvm.load(art)
print(name, "shipped", shipped, "direct" if mod._direct else "no direct path", flush=True)
runs = {}
if mod._direct is not None:
    import onnxruntime as ort
    import openvino as ov
    lib = mod.manifest["regions"][0]["backend"]
    names = [i["name"] for i in mod.inputs]
    if lib == "onnxruntime":
        o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.inter_op_num_threads = 1
        sess = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
        feed = dict(zip(names, arrays))
        runs["framework"] = lambda: sess.run(None, feed)
    else:
        core = ov.Core()
        cm = core.compile_model(path, "CPU", {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 2,
                                               "INFERENCE_PRECISION_HINT": "f32"})
        req = cm.create_infer_request()
        runs["framework"] = lambda: req.infer(arrays, share_inputs=True, share_outputs=True)
    runs["load()(numpy), direct"] = lambda: mod(*arrays)
def via_vm():  # what load()(numpy) did before the direct call
    return mod._call_vm(arrays)
runs["load()(numpy), via the VM"] = via_vm
tensors = [mod.to_device(a, s) for a, s in zip(arrays, mod.inputs)]
runs["vm main on TVM tensors (the suites' call)"] = lambda: mod.run_tvm(tensors)
ref = via_vm()
got = mod(*arrays)
got = list(got) if isinstance(got, tuple) else [got]
assert all(np.array_equal(a, b) for a, b in zip(ref, got)), "direct != VM"
samples = {}
ms = interleaved(runs, rounds=45, min_ms=100.0, samples=samples)
doc = {"model": name, "input": [list(a.shape) for a in arrays], "shipped": shipped,
       "search_s": round(search_s, 1), "rounds": 45, "ms": ms,
       "batches": {k: [round(x, 4) for x in v] for k, v in samples.items()},
       "machine": bench.machine()}
json.dump(doc, open(out, "w"), indent=1)
for k, v in ms.items():
    print(f"  {k}: {v:.4f} ms", flush=True)
