"""``collage-tvm bench --suite NAME --dynamic``: models exported with dynamic axes, as users
ship them, timed at many shapes (issue #77).

Each model is exported as its users export it for serving: torchvision and timm models with
a dynamic batch axis (PyTorch's tutorial export), transformers configs with dynamic batch and
sequence (as optimum writes them; ViT and Whisper's encoder: a dynamic batch). Then
``collage_tvm.optimize(file)`` with no other argument (the ranges are the defaults read from
the model), saved and loaded back, and at each timed shape (images: batch 1, 4, 8; tokens:
batch 1, 4, 8 x sequence 8, 32, 128, 512; and one shape between the search's points, batch
3 x sequence 100, images batch 3) timed interleaved in this process beside the same
dynamic file on ONNX Runtime, OpenVINO at f32 and at its default precision, and PyTorch
eager (``bench.torch_frameworks``), each output checked against PyTorch's. A row per
(model, shape); the figures the issue asks for are in ``summary``.

Each model is searched from an empty cost DB of its own (``--db`` given: that one), so its
search time against the search at the optimum inside it (``static_s``) is what a new user
waits; then it is built again from that DB (a warm rebuild: ``rebuild_s``, and whether it
measured anything).
"""
from __future__ import annotations

import math
import os
import statistics
import time

from .._errors import first_line

DYNAMIC_SUITES = {
    "torchvision": ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large",
                    "efficientnet_b0", "densenet121", "squeezenet1_1", "shufflenet_v2_x1_0",
                    "regnet_y_400mf", "convnext_tiny"),
    "timm": ("resnet18", "efficientnet_b0", "mobilenetv3_large_100", "convnext_atto",
             "regnety_002", "ghostnet_100", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
             "levit_128s", "mixer_s16_224", "repvgg_a0", "densenet121"),
    "transformers": ("bert", "roberta", "distilbert", "gpt2", "gpt_neo", "t5_encoder",
                     "vit", "whisper_encoder", "llama", "gpt2_decode_step"),
}
BATCHES = (1, 4, 8)
SEQUENCES = (8, 32, 128, 512)
# One more row per model at a shape between the search's points (batch 3, sequence or cache
# 100): served by the choice at the next point above it, never by a file compiled for a
# point's exact shapes, as a server's calls mostly are
BETWEEN_BATCH = 3
BETWEEN_SEQUENCE = 100
POSITIONS = 512  # the transformers configs' positions, for sequences up to 512
IMAGE_INPUT = {"vit": "pixel_values", "whisper_encoder": "input_features"}


def decode_step(layers: int = 4, width: int = 256, heads: int = 4, vocab: int = 1000,
                positions: int = POSITIONS):
    """A GPT-2-style decode step with a key/value cache, defined in code (random weights):
    ``forward(token, past_0_key, past_0_value, ...)``: the next token's ids (batch, 1) and
    each layer's cache (batch, heads, past, width / heads) -> the logits (batch, 1, vocab)
    and each layer's cache one position longer. 2 x ``layers`` cache inputs (8 by default),
    as a serving loop calls a decoder."""
    import torch
    import torch.nn as nn

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.wte = nn.Embedding(vocab, width)
            self.position_embeddings = nn.Embedding(positions + 1, width)
            self.blocks = nn.ModuleList(nn.ModuleDict({
                "ln1": nn.LayerNorm(width), "qkv": nn.Linear(width, 3 * width),
                "proj": nn.Linear(width, width), "ln2": nn.LayerNorm(width),
                "fc": nn.Linear(width, 4 * width), "out": nn.Linear(4 * width, width)})
                for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, token, *past):
            b = token.shape[0]
            n = past[0].shape[2]
            pos = torch.full_like(token, 0) + n
            x = self.wte(token) + self.position_embeddings(pos)
            caches = []
            for k, blk in enumerate(self.blocks):
                q, key, value = blk["qkv"](blk["ln1"](x)).split(width, dim=-1)
                shape = (b, 1, heads, width // heads)
                q, key, value = (t.reshape(shape).transpose(1, 2) for t in (q, key, value))
                key = torch.cat([past[2 * k], key], dim=2)
                value = torch.cat([past[2 * k + 1], value], dim=2)
                caches += [key, value]
                att = torch.softmax(q @ key.transpose(-1, -2) / (width // heads) ** 0.5, -1)
                y = (att @ value).transpose(1, 2).reshape(b, 1, width)
                x = x + blk["proj"](y)
                x = x + blk["out"](torch.nn.functional.gelu(blk["fc"](blk["ln2"](x))))
            return (self.head(self.ln_f(x)), *caches)

    model = Step().eval()
    token = torch.zeros(1, 1, dtype=torch.int64)
    cache = torch.randn(1, heads, 16, width // heads)
    return model, (token, *([cache] * (2 * layers)))


def dynamic_case(suite: str, name: str) -> dict:
    """Model ``name`` of dynamic ``suite`` as it is exported and timed: {"model", "inputs"
    (example torch tensors), "names" (the inputs'), "axes" (input name -> its dynamic axes),
    "outputs" (output name -> its dynamic axes), "shapes" (per timed point, one shape per
    input), "between" (the same for the shape between the search's points)}."""
    from . import suites

    if name == "gpt2_decode_step":
        model, inputs = decode_step()
        layers = (len(inputs) - 1) // 2
        caches = [f"past_{k}_{kv}" for k in range(layers) for kv in ("key", "value")]
        heads, width = inputs[1].shape[1], inputs[1].shape[3]
        return {"model": model, "inputs": inputs, "names": ["token", *caches],
                "axes": {"token": {0: "batch"}, **{c: {0: "batch", 2: "past"} for c in caches}},
                "outputs": {"logits": {0: "batch"},
                            **{c.replace("past", "present"): {0: "batch", 2: "present"}
                               for c in caches}},
                "shapes": [[(b, 1)] + [(b, heads, p, width)] * len(caches)
                           for b in BATCHES for p in SEQUENCES],
                "between": [(BETWEEN_BATCH, 1)] + [(BETWEEN_BATCH, heads, BETWEEN_SEQUENCE,
                                                    width)] * len(caches)}
    if suite == "transformers":
        model, inputs = suites.transformers_model(name, "usual", positions=POSITIONS)
        if name in IMAGE_INPUT:
            shape = tuple(inputs[0].shape)
            return {"model": model, "inputs": inputs, "names": [IMAGE_INPUT[name]],
                    "axes": {IMAGE_INPUT[name]: {0: "batch"}},
                    "outputs": {"last_hidden_state": {0: "batch"}},
                    "shapes": [[(b, *shape[1:])] for b in BATCHES],
                    "between": [(BETWEEN_BATCH, *shape[1:])]}
        return {"model": model, "inputs": inputs, "names": ["input_ids"],
                "axes": {"input_ids": {0: "batch", 1: "sequence"}},
                "outputs": {"last_hidden_state": {0: "batch", 1: "sequence"}},
                "shapes": [[(b, q)] for b in BATCHES for q in SEQUENCES],
                "between": [(BETWEEN_BATCH, BETWEEN_SEQUENCE)]}
    make = {"torchvision": suites.torchvision_model, "timm": suites.timm_model}[suite]
    model, inputs = make(name, "usual")
    shape = tuple(inputs[0].shape)
    return {"model": model, "inputs": inputs, "names": ["x"], "axes": {"x": {0: "batch"}},
            "outputs": {"output": {0: "batch"}},
            "shapes": [[(b, *shape[1:])] for b in BATCHES],
            "between": [(BETWEEN_BATCH, *shape[1:])]}


def export_dynamic(case: dict, path: str) -> str:
    """``case``'s model exported to ``path`` with its dynamic axes named, as a user exports
    it for serving (TorchScript exporter, opset 17)."""
    from ..frontend.model_file import export_torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return export_torch(case["model"], tuple(case["inputs"]), path, input_names=case["names"],
                        output_names=list(case["outputs"]),
                        dynamic_axes={**case["axes"], **case["outputs"]})


def shape_inputs(examples, shapes: list, seed: int) -> tuple:
    """Torch tensors of ``shapes`` like ``examples``: token ids below 1000, else normal."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 1000, shape, generator=g, dtype=ex.dtype)
                 if ex.dtype in (torch.int64, torch.int32) else torch.randn(shape, generator=g)
                 for ex, shape in zip(examples, shapes))


def run_model(suite: str, name: str, out_dir: str, options, db, log=print) -> list:
    """The rows of one model: exported, optimized with no flags, saved and loaded, timed at
    each of its shapes. A failure is one row with "error"."""
    import shutil

    from .. import load, optimize
    from ..artifact import save
    from .bench import torch_frameworks
    from .suites import (CONTROL, OPENVINO_CONTROL, OPENVINO_F32_CONTROL, _framework_check,
                         quietest, versus)

    try:
        case = dynamic_case(suite, name)
        path = export_dynamic(case, os.path.join(out_dir, name, f"{name}.onnx"))
    except Exception as err:  # noqa: BLE001 - a model that cannot be made or exported here
        return [{"model": name, "error": f"export: {first_line(err, 300)}"}]
    cold = db is None  # (an empty DB of its own: the search a new user waits for)
    if cold:  # (its placement log and tuning records beside it)
        shutil.rmtree(os.path.join(out_dir, name, "db"), ignore_errors=True)
        db = os.path.join(out_dir, name, "db", "costs.db")
        os.makedirs(os.path.dirname(db))
    t0 = time.perf_counter()
    try:
        res = optimize(path, "llvm", options=options, db=db)
    except Exception as err:  # noqa: BLE001 - the row says why
        return [{"model": name, "error": f"optimize: {first_line(err, 300)}"}]
    search_s = time.perf_counter() - t0
    d = res.report.dynamic
    info = {"model": name, "search_s": round(search_s, 1), "cold_db": cold,
            "static_s": d.get("static_s"), "points_s": d.get("points_s"),
            "ranges": d.get("described", "static"), "shipped": res.report.shipped,
            "static_shipped": d.get("static_shipped", "")}
    del res
    t0 = time.perf_counter()
    try:  # a warm rebuild: the same file and DB
        again = optimize(path, "llvm", options=options, db=db)
        info.update(rebuild_s=round(time.perf_counter() - t0, 1),
                    rebuild=again.report.summary(),
                    rebuild_measured=not again.report.placement_from_log)
        res = again
    except Exception as err:  # noqa: BLE001 - the row says why; the first build serves
        info["rebuild"] = f"error: {first_line(err, 200)}"
        res = optimize(path, "llvm", options=options, db=db)
    folder = os.path.join(out_dir, name, "shipped")
    save(res, folder)
    del res
    loaded = load(folder)
    info["load_s"] = round(loaded.load_seconds, 2)
    log(f"  {name}: searched in {search_s:.0f} s (at the optimum {info['static_s']} s), "
        f"{info['shipped']}; rebuilt in {info.get('rebuild_s', '-')} s: {info['rebuild']}")
    rows = []
    check = _framework_check(1e-3, 1e-4)
    controls = {CONTROL: "onnxruntime", OPENVINO_F32_CONTROL: "openvino"}
    accuracy = "f32" if options.accuracy.strict else options.accuracy.name
    if accuracy != "f32":  # judged against OpenVINO at its default precision too
        controls[OPENVINO_CONTROL] = "openvino (default)"
    timed = [(shapes, False) for shapes in case["shapes"]] + [(case["between"], True)]
    for k, (shapes, between) in enumerate(timed):
        xs = shape_inputs(case["inputs"], shapes, seed=k)
        row = {**info, "shape": ", ".join("x".join(map(str, s)) for s in shapes[:2])
               + (", ..." if len(shapes) > 2 else ""), **({"between": True} if between else {})}
        try:
            share, fws, tries = quietest(
                lambda: torch_frameworks(case["model"], xs, path, loaded, check,
                                         controls=controls, label=f"{name} {row['shape']}"),
                f"{name} {row['shape']}")
            if loaded.dispatch is not None:  # (its race at these shapes decided: ``settle``)
                row["served_by"] = loaded.dispatch.label_for(shapes)
                race = loaded.dispatch.race_at(shapes)
                if race is not None:
                    row["race"] = race.record
            if accuracy != "f32" and "error" not in fws.get("collage", {}):
                # (judged within its budget, as OpenVINO's default is within its precision)
                mine = fws["collage"]
                mine.update(precision=accuracy, match=bool(
                    mine.get("rel_err", math.inf) <= options.accuracy.tolerance))
            row.update(frameworks=fws, frameworks_other_load=share, **versus(fws))
            if len(tries) > 1:
                row["frameworks_loads"] = [t[0] for t in tries]
                row["frameworks_aa_spreads"] = [t[1] for t in tries]
        except Exception as err:  # noqa: BLE001 - the row says why
            row["error"] = first_line(err, 300)
        rows.append(row)
        log(f"    {row['shape']}: " + (row.get("error") or _row_text(row)))
    del loaded
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def _row_text(row: dict) -> str:
    best = row.get("best_f32")
    ratio = row.get("vs_best_f32")
    fw = row.get("frameworks", {})
    return (f"collage {fw.get('collage', {}).get('ms', math.nan):.3f} ms"
            f" ({row.get('served_by', '?')}), best f32 {best[0] if best else '-'}"
            f" {best[1] if best else math.nan:.3f} ms: "
            + (f"{ratio:.3f}x" if ratio else "-"))


MEAN_OF = ("onnxruntime", "openvino", "openvino (default)", "pytorch")


def summary(rows: list) -> dict:
    """The issue's figures: Collage over the best f32 framework (median, worst, rows below
    0.97x), the rows where it beats every f32 framework by 3% or more, each framework's
    mean (geometric) ratio of its time over Collage's, and the search time against the
    search at one shape."""
    from .suites import CLEAR_WIN

    timed = [r for r in rows if r.get("vs_best_f32")]
    out = {"rows": len(rows), "timed": len(timed), "errors": len(rows) - len(timed)}
    if timed:
        stats = _ratio_stats(timed, "vs_best_f32")
        out.update(median=stats["median"], worst=stats["worst"],
                   below_goal=stats["below_goal"],
                   clear_wins=[(r["model"], r["shape"], r["vs_best_f32"]) for r in timed
                               if r["vs_best_f32"] >= CLEAR_WIN])
    between = [r for r in timed if r.get("between")]
    if between:  # (the shapes between the search's points: ``BETWEEN_BATCH``, ...)
        out["between"] = _ratio_stats(between, "vs_best_f32")
    defaults = [r for r in timed if r.get("vs_openvino_default")]
    if defaults:  # (a reduced budget's rows: against OpenVINO at its default precision)
        out["vs_openvino_default"] = _ratio_stats(defaults, "vs_openvino_default")
    means = {}
    for fw in MEAN_OF:
        logs = [math.log(r["frameworks"][fw]["ms"] / r["frameworks"]["collage"]["ms"])
                for r in timed if r["frameworks"].get(fw, {}).get("match")
                and math.isfinite(r["frameworks"][fw].get("ms", math.nan))]
        if logs:
            means[fw] = math.exp(statistics.fmean(logs))
    out["framework_mean_over_collage"] = means
    searches = {r["model"]: (r["search_s"], r.get("static_s")) for r in rows if "search_s" in r}
    out["search_over_static"] = {m: round(s / st, 2) for m, (s, st) in searches.items()
                                 if st}
    cold = {r["model"] for r in rows if r.get("cold_db")}
    if cold:
        out["cold_searches"] = sorted(cold)
    rebuilt = {r["model"]: r for r in rows if "rebuild_s" in r}
    if rebuilt:
        out["rebuild"] = {"models": len(rebuilt),
                          "max_s": max(r["rebuild_s"] for r in rebuilt.values()),
                          "measured": sorted(m for m, r in rebuilt.items()
                                             if r["rebuild_measured"])}
    return out


def _ratio_stats(rows: list, key: str) -> dict:
    """{"rows", "median", "worst": (model, shape, ratio), "below_goal"} of ratio ``key``
    over ``rows`` (each has it)."""
    from .suites import GOAL

    worst = min(rows, key=lambda r: r[key])
    return {"rows": len(rows), "median": statistics.median(r[key] for r in rows),
            "worst": (worst["model"], worst["shape"], worst[key]),
            "below_goal": sum(r[key] < GOAL for r in rows)}


def markdown(suite: str, rows: list, machine: dict | None = None) -> str:
    """The table of one dynamic suite: a row per (model, shape)."""
    from .suites import machine_line

    lines = [f"### {suite}, dynamic axes" + (f" ({machine_line(machine)})" if machine else ""),
             "", "| model | shape | served by | Collage ms | ONNX Runtime | OpenVINO f32 | "
             "OpenVINO default | PyTorch | Collage / best f32 |", "|---|---|---|---:|---:|---:|"
             "---:|---:|---:|"]
    for r in rows:
        if r.get("error") and "frameworks" not in r:
            lines.append(f"| {r['model']} | {r.get('shape', '')} | error: {r['error'][:80]} "
                         "| | | | | | |")
            continue
        fw = r.get("frameworks", {})

        def cell(name):
            f = fw.get(name, {})
            if "error" in f or not math.isfinite(f.get("ms", math.nan)):
                return "-"
            return f"{f['ms']:.3f}" + ("" if f.get("match") else " (wrong)")

        ratio = r.get("vs_best_f32")
        shape = r["shape"] + (" (between points)" if r.get("between") else "")
        lines.append(f"| {r['model']} | {shape} | {r.get('served_by', '-')} | "
                     f"{cell('collage')} | {cell('onnxruntime')} | {cell('openvino')} | "
                     f"{cell('openvino (default)')} | {cell('pytorch')} | "
                     + (f"{ratio:.3f}x" if ratio else "-") + " |")
    s = summary(rows)
    lines.append("")
    if "median" in s:
        lines.append(f"Collage / best f32 framework over {s['timed']} rows: median "
                     f"{s['median']:.3f}x, worst {s['worst'][2]:.3f}x ({s['worst'][0]} "
                     f"{s['worst'][1]}), {s['below_goal']} below 0.97x; "
                     f"{len(s['clear_wins'])} rows beat every f32 framework by 3% or more.")
    b = s.get("between")
    if b:
        lines.append(f"At a shape between the search's points (served by the choice at the "
                     f"next point above it), {b['rows']} rows: median {b['median']:.3f}x, "
                     f"worst {b['worst'][2]:.3f}x ({b['worst'][0]} {b['worst'][1]}), "
                     f"{b['below_goal']} below 0.97x.")
    d = s.get("vs_openvino_default")
    if d and any(r.get("frameworks", {}).get("collage", {}).get("precision", "f32") != "f32"
                 for r in rows):
        lines.append(f"Collage / OpenVINO at its default precision over {d['rows']} rows: "
                     f"median {d['median']:.3f}x, worst {d['worst'][2]:.3f}x ({d['worst'][0]} "
                     f"{d['worst'][1]}), {d['below_goal']} below 0.97x.")
    if s["framework_mean_over_collage"]:
        lines.append("Each framework's time over Collage's, geometric mean over the rows: "
                     + ", ".join(f"{n} {v:.3f}x" for n, v in
                                 s["framework_mean_over_collage"].items()) + ".")
    if s["search_over_static"]:
        where = ("from an empty cost DB" if set(s.get("cold_searches", ())) >=
                 set(s["search_over_static"]) else "from the cost DB as it was")
        lines.append(f"Search time over the range against the search at the optimum inside it "
                     f"({where}): " + ", ".join(f"{m} {v:.2f}x" for m, v in
                                                 s["search_over_static"].items()) + ".")
    r = s.get("rebuild")
    if r:
        lines.append(f"A warm rebuild (the same file and DB) took at most {r['max_s']:.0f} s "
                     f"and measured nothing for {r['models'] - len(r['measured'])} of "
                     f"{r['models']} models" + (f" (measured: {', '.join(r['measured'])})"
                                                 if r["measured"] else "") + ".")
    return "\n".join(lines) + "\n"


def run(suite: str, names, out_dir: str, options, db, on_row=None, log=print) -> list:
    """Every model of dynamic ``suite`` (``names``: only those), rows as ``run_model``;
    ``on_row(rows)`` after each model."""
    return each_model(DYNAMIC_SUITES, "dynamic", run_model, suite, names, out_dir, options,
                      db, on_row, log)


def each_model(suites: dict, kind: str, run_model, suite: str, names, out_dir: str, options,
               db, on_row=None, log=print) -> list:
    """The rows of ``run_model(suite, name, out_dir, options, db, log)`` for every model of
    ``suites[suite]`` (``names``: only those), ``on_row(rows)`` after each model."""
    if suite not in suites:
        raise ValueError(f"no {kind} suite {suite!r}: one of {', '.join(suites)}")
    rows = []
    for name in suites[suite] if names is None else names:
        log(f"== {suite} {name} ({kind})")
        rows.extend(run_model(suite, name, out_dir, options, db, log))
        if on_row is not None:
            on_row(rows)
    return rows


__all__ = ["DYNAMIC_SUITES", "markdown", "run", "summary"]
