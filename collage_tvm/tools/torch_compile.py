"""The torch.compile figures of issue #36 (``collage-tvm bench --torch-compile``): a model
compiled with ``torch.compile(backend="collage")`` in a fresh process (the search), then
again in a second fresh process sharing the cost DB and placement log (no search), each
checked against eager, the compile times and the compiled model's latency beside eager's
(interleaved) written to a results file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

#: model name -> (what builds it, the example inputs, as Python source in the child)
MODELS = {
    "resnet18": ("collage_tvm.tools.torch_compile:resnet18", "(torch.randn(1, 3, 224, 224),)"),
    "bert_break": ("collage_tvm.tools.torch_compile:bert_with_break",
                   "(torch.randint(0, 1000, (1, 128)), torch.ones(1, 128, dtype=torch.long))"),
}


def resnet18():
    """torchvision's ResNet-18, random weights."""
    from .._torchvision import import_torchvision

    return import_torchvision().models.resnet18(weights=None)


def bert_with_break():
    import torch

    from .._torchvision import import_torchvision

    import_torchvision()  # transformers imports torchvision (collage_tvm._torchvision)
    from transformers import BertConfig, BertModel

    class BertWithBreak(torch.nn.Module):
        """A BERT-base-sized encoder of 4 layers from a config (random weights), then a
        graph break and a small head: two Dynamo graphs."""

        def __init__(self):
            super().__init__()
            self.bert = BertModel(BertConfig(vocab_size=1000, num_hidden_layers=4,
                                             max_position_embeddings=128))

        def forward(self, ids, mask):
            h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
            torch._dynamo.graph_break()
            return torch.tanh(h[:, 0]), h.mean(1)

    return BertWithBreak()


_CHILD = r"""
import importlib, json, sys, time
import torch
from collage_tvm.measure.timing import interleaved
from collage_tvm.torch_backend import builds
spec, inputs, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
mod, _, name = spec.partition(":")
torch.manual_seed(0)
m = getattr(importlib.import_module(mod), name)().eval()
x = eval(inputs)
f = torch.compile(m, backend="collage", dynamic=False, options=options)
with torch.inference_mode():
    t0 = time.perf_counter()
    got = f(*x)
    first_call = time.perf_counter() - t0
    want = m(*x)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    err = max(float((a - b).abs().max() / max(1e-12, float(b.abs().max()))) for a, b in zip(got, want))
    ms = interleaved({"eager": lambda: m(*x), "collage": lambda: f(*x)}, rounds=5)
print("RESULT", json.dumps({"first_call_s": first_call, "rel_err": err, "eager_ms": ms["eager"],
      "compiled_ms": ms["collage"], "graphs": [{"built": b.built, "seconds": b.seconds,
      "from_log": bool(b.report and b.report.placement_from_log),
      "shipped": b.report.shipped if b.report else None, "fallback": b.fallback}
      for b in builds()]}))
"""


def _fresh(spec: str, inputs: str, options: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", _CHILD, spec, inputs, json.dumps(options)],
                         capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"torch.compile of {spec} failed:\n{run.stderr[-3000:]}")
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def row(name: str, db: str, options: dict | None = None) -> dict:
    """Two fresh processes compiling ``MODELS[name]`` with one cost DB and placement log:
    {"model", "options", "first": ..., "second": ...} (each: its graphs' compile seconds,
    whether the placement came from the log, the error against eager and both latencies)."""
    spec, inputs = MODELS[name]
    opts = {"db": db, **(options or {})}
    first = _fresh(spec, inputs, opts)
    second = _fresh(spec, inputs, opts)
    return {"model": name, "inputs": inputs, "options": {k: v for k, v in opts.items()
                                                         if k != "db"},
            "first": first, "second": second}


def run(names: list, out_dir: str, db: str | None = None, options: dict | None = None) -> str:
    """``row`` for each of ``names`` into ``out_dir/torch_compile.json``; returns its path.
    ``db``: the cost DB (default: a fresh one in ``out_dir``, so the first process searches)."""
    from .bench import machine

    os.makedirs(out_dir, exist_ok=True)
    db = db or os.path.join(out_dir, f"torch-compile-{int(time.time())}.db")
    doc = {"machine": machine(), "rows": []}
    path = os.path.join(out_dir, "torch_compile.json")
    for name in names:
        if name not in MODELS:
            raise ValueError(f"unknown torch.compile model {name!r} (known: {', '.join(MODELS)})")
        r = row(name, db, options)
        doc["rows"].append(r)
        f, s = r["first"], r["second"]
        print(f"{name}: first process {sum(g['seconds'] for g in f['graphs']):.1f} s of "
              f"Collage builds ({len(f['graphs'])} graphs), second "
              f"{sum(g['seconds'] for g in s['graphs']):.1f} s (placement from the log: "
              f"{all(g['from_log'] for g in s['graphs'])}); error vs eager {s['rel_err']:.1e}; "
              f"eager {s['eager_ms']:.2f} ms, compiled {s['compiled_ms']:.2f} ms", flush=True)
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
    return path
