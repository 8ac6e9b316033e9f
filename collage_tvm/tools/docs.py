"""The measured tables of the docs, rendered from the results files beside them (issue #34).

A page (docs/BENCHMARKS.md, docs/COVERAGE.md) marks each rendered block::

    <!-- rendered: KIND results/FILE.json [results/OTHER.json ...] -->
    ...the table, written by this module...
    <!-- end rendered -->

and ``render_page`` replaces what lies between the markers with the table rendered from the
named files (paths relative to the page's folder). Kinds:

- ``suite-table``: one ``bench --suite`` results file's table (``suites.markdown``).
- ``suite-summary``: one line per suite file: the rows, the median and worst of Collage
  against the best f32 framework (and against OpenVINO at its default precision, for a
  file searched under a reduced accuracy budget), the rows below the goal, the clear and
  the mixed wins, and the rows whose search ended on a mix at all.
- ``optimize-report``: an ``optimize`` report's final check (``BuildReport.comparison``):
  every build it timed, its latency, correctness and operators per backend.
- ``call-tir-survey``: what TVM's ONNX importer writes as ``call_tir`` and what is raised
  (``tools.call_tir_survey``'s JSON).
- ``gpu``: each ``bench --target cuda`` model of ``results.json`` files: the searched and the
  shipped build beside PyTorch eager and ``torch.compile`` (default, CUDA graphs).
- ``deploy``: each ``bench --deploy`` model of ``results.json`` files: saved, loaded in a
  fresh process beside an ONNX Runtime session, timed beside the in-process build.

``python -m collage_tvm.tools.docs`` renders every page; ``--check`` exits 1, naming the
pages, when rendering would change one (the test suite runs it: the pages never drift from
their results files).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from . import suites

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ("BENCHMARKS.md", "COVERAGE.md")
_BLOCK = re.compile(r"(<!-- rendered: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end rendered -->)",
                    re.S)


def _load(folder: Path, name: str) -> dict:
    path = folder / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: the results file a rendered block names is missing")
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a results file ({err})") from None


def int8_suite_table(doc: dict) -> str:
    """An int8 suite's table (``bench --suite NAME --int8``): two rows per model."""
    from . import int8_suite

    return int8_suite.markdown(doc["suite"], doc["rows"], doc.get("machine"))


def dynamic_suite_table(doc: dict) -> str:
    """A dynamic suite's table (``bench --suite NAME --dynamic``): a row per (model, shape)."""
    from . import dynamic_suite

    return dynamic_suite.markdown(doc["suite"], doc["rows"], doc.get("machine"))


def schedule_suite_table(doc: dict) -> str:
    """A schedule suite's table (``bench --suite NAME --schedule``): a row per (model, batch)."""
    from . import schedule_suite

    return schedule_suite.markdown(doc["suite"], doc["rows"], doc.get("machine"))


def suite_table(doc: dict) -> str:
    return suites.markdown(doc["suite"], doc["rows"], doc.get("machine"))


def _x(v) -> str:
    return f"{v:.2f}x"


def _machines(docs: list) -> list:
    """The machine lines of the results files, each once, in order."""
    out: list = []
    for doc in docs:
        line = suites.machine_line(doc.get("machine") or {})
        if line not in out:
            out.append(line)
    return out


def suite_summary(docs: list) -> str:
    """One row per suite results file (see the module's docstring)."""
    several = len(_machines(docs)) > 1  # then each row names its machine's CPU
    head = ["suite"] + (["machine"] if several else []) + [
            "accuracy", "input", "rows", "median vs best f32", "worst", "below "
            f"{suites.GOAL}x", "median vs OpenVINO default", "worst", f"below {suites.GOAL}x",
            "wins by 3%+", "mixed placements shipped", "mixed wins by 3%+",
            "search ended on a mix (nearest)"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|---|" + "---|" * several + "---:|" * (len(head) - 3 - several)]
    for doc in docs:
        rows, accuracy = doc["rows"], doc.get("accuracy", "f32")
        f32 = suites.suite_stats(rows, "vs_best_f32")
        default = suites.suite_stats(rows, "vs_openvino_default") if accuracy != "f32" else None
        machine = [suites.cpu_name(doc.get("machine") or {})] if several else []
        cells = [doc["suite"], *machine, accuracy, doc.get("input_size", ""), str(len(rows))]
        for st in (f32, default):
            cells += ([_x(st["median"]), f"{st['worst'][1]:.3f}x ({st['worst'][0]})",
                       _below(st)] if st else ["", "", ""])
        main = default or f32
        cells += [str(len(main["wins"])) if main else "", str(len(main["mixed"])) if main else "",
                  ", ".join(main["mixed_wins"]) or "0" if main else "", _searched(main)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(_machines(docs) + [""] + lines) + "\n"


def _searched(st: dict | None) -> str:
    """How many rows' search ended on a mixed placement, and the nearest of them to the
    fastest single build (``suites.searched_a_mix``)."""
    if not st:
        return ""
    searched = st["searched_mixed"]
    return str(len(searched)) + (f" ({searched[0][1]:.2f}x, {searched[0][0]})"
                                 if searched else "")


def _below(st: dict) -> str:
    """How many rows are below the goal, and how many of them by more than their A/A
    control's spread where the rows have one (``suites.within_noise``)."""
    below, beyond = st["below"], st["below_beyond_noise"]
    return str(len(below)) + (f" ({len(beyond)} beyond A/A noise)" if st["say_beyond"] else "")


def optimize_report(doc: dict) -> str:
    """The final check of one ``optimize`` report (``BuildReport`` as JSON)."""
    # (a build not built or not timed: its "ms" is written as null)
    comp = {n: {**r, "ms": math.nan if r.get("ms") is None else r["ms"],
                "max_err": math.nan if r.get("max_err") is None else r["max_err"],
                "rel_err": math.nan if r.get("rel_err") is None else r["rel_err"]}
            for n, r in (doc.get("comparison") or {}).items()}
    lines = [f"Shipped: {doc.get('shipped', '?')}" + (f" (target {doc['target']})"
                                                       if doc.get("target") else ""), "",
             "| build | ms | correct | max err (rel err) | operators per backend |",
             "|---|---:|---|---:|---|"]
    order = sorted(comp, key=lambda n: (not math.isfinite(comp[n].get("ms", math.nan)),
                                        comp[n].get("ms", math.inf)))
    for name in order:
        r = comp[name]
        ms = r.get("ms", math.nan)
        ops = ", ".join(f"{b} {n}" for b, n in sorted((r.get("ops") or {}).items(),
                                                      key=lambda bn: -bn[1]))
        mark = " (shipped)" if name == doc.get("shipped") else ""
        if r.get("outside_budget"):  # timed for the report's advice, never shipped
            mark += f" (outside the accuracy budget: {r['outside_budget']}, advice only)"
        if not math.isfinite(ms) and r.get("error"):  # not built: the reason instead
            lines.append(f"| {name}{mark} | not built | - | - | {r['error'][:90]} |")
            continue
        lines.append(f"| {name}{mark} | {ms:.3f} | {'yes' if r.get('match') else 'no'} | "
                     f"{r.get('max_err', math.nan):.1e} ({r.get('rel_err', math.nan):.1e}) | "
                     f"{ops} |")
    return "\n".join(lines) + "\n"


def deploy_table(docs: list) -> str:
    """Each ``bench --deploy`` model of the results files: the build saved, loaded in a fresh
    process beside an ONNX Runtime session, and timed beside the in-process build."""
    lines, machines = [], _machines(docs)
    head = ["model", "size", "saved MB", "load s (fresh process)", "ONNX Runtime session s",
            "load / session", "first run s", "outputs bit-identical", "in-process ms",
            "loaded ms"]
    rows = []
    for doc in docs:
        for m in doc.get("models", []):
            d = m.get("deploy")
            if not d:
                continue
            rows.append([m["model"], m.get("size", ""), f"{d['bytes'] / 2**20:.1f}",
                         f"{d['load_s']:.3f}", f"{d['ort_session_s']:.3f}",
                         f"{d['load_vs_ort']:.2f}x", f"{d['first_run_s']:.3f}",
                         "yes" if d["identical"] else "**NO**", f"{d['in_process_ms']:.3f}",
                         f"{d['loaded_ms']:.3f}"])
    lines += machines + ["", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * 5
                         + "---|---:|---:|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def torch_compile_table(docs: list) -> str:
    """``bench --torch-compile``: each model compiled in a fresh process (searching), then in
    a second one (the placement log answers), checked against eager, timed beside it."""
    lines, machines, rows = [], _machines(docs), []
    for doc in docs:
        for r in doc.get("rows", []):
            f, s = r["first"], r["second"]
            built = all(g["built"] for g in f["graphs"] + s["graphs"])
            o = r.get("options", {})
            opts = (", ".join(o.get("backends") or ["every backend"])
                    + ("; both levels" if o.get("graph_level", True) else "; op level"))
            rows.append([r["model"], opts, str(len(f["graphs"])),
                         f"{sum(g['seconds'] for g in f['graphs']):.1f}",
                         f"{sum(g['seconds'] for g in s['graphs']):.1f}",
                         "yes" if all(g["from_log"] for g in s["graphs"]) else "**no**",
                         "yes" if built else "**no** (eager)", f"{s['rel_err']:.1e}",
                         f"{s['eager_ms']:.2f}", f"{s['compiled_ms']:.2f}"])
    head = ["model", "search", "graphs", "first process: build s", "second process: build s",
            "placement from the log", "built", "error vs eager (of the scale)", "eager ms",
            "compiled ms"]
    lines += machines + ["", "| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---|---|"
                         + "---:|" * 3]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


GPU_FRAMEWORKS = ("pytorch (cuda)", "torch.compile", "torch.compile (cuda graphs)")


def gpu_table(docs: list) -> str:
    """``bench --target cuda`` models: what the search placed and what shipped (the final
    check's pick), beside PyTorch eager, ``torch.compile`` and ``torch.compile`` in CUDA
    graphs (``reduce-overhead``), interleaved on the GPU after the search."""
    lines, machines, rows = [], _machines(docs), []
    for doc in docs:
        for m in doc.get("models", []):
            e, fw = m.get("two-level") or m.get("op-level") or {}, m.get("frameworks", {})
            comparison = e.get("comparison") or {}
            searched = comparison.get("collage", {})
            ops = ", ".join(f"{b} {n}" for b, n in sorted(searched.get("ops", {}).items()))
            others = [fw[f]["ms"] for f in GPU_FRAMEWORKS
                      if f in fw and fw[f].get("match") and math.isfinite(fw[f].get("ms", math.nan))]
            mine = fw.get("collage", {})
            ok = all(r.get("match", True) for r in fw.values())
            rows.append([m["model"], m.get("size", ""), f"{ops} ({searched.get('ms', math.nan):.3f})",
                         _shipped_name(e), _ms(mine, 3)] + [_ms(fw.get(f), 3) for f in GPU_FRAMEWORKS]
                        + [_x(min(others) / mine["ms"]) if others and mine.get("ms") else "",
                           "yes" if ok else "**NO**"])
    head = (["model", "size", "searched placement (ms)", "shipped", "Collage ms"]
            + [f"{f} ms" for f in GPU_FRAMEWORKS] + ["Collage vs the best of them",
                                                   "all outputs match PyTorch f32"])
    lines += machines + ["", "| " + " | ".join(head) + " |", "|---|---|---|---|" + "---:|" * 5
                         + "---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


SEARCH_STAGES = ("import", "measure", "second pass", "re-time", "calibrate", "graph-level",
                 "compare")


def search_time_table(docs: list) -> str:
    """``bench`` runs from an empty cost DB: each search's wall time, its stages, what it
    measured (``--lean``: how many candidates it never measured, why it stopped) and what
    it shipped, one row per results file and model."""
    lines, machines, rows = [], _machines(docs), []
    for doc in docs:
        for m in doc.get("models", []):
            for level in ("two-level", "op-level"):
                e = m.get(level)
                if not e:
                    continue
                lean = e.get("lean") or {}
                how = (f"lean: {lean['measured']} measured, {lean['skipped']} skipped, "
                       f"stopped by {lean.get('stopped') or 'measured'}" if lean
                       else "every candidate")
                t = e.get("times", {})
                comparison = e.get("comparison") or {}
                shipped = comparison.get(e.get("shipped") or "collage", {})
                shipped = comparison.get(shipped.get("same_as"), shipped)
                best = shipped.get("ms", math.nan)
                rows.append([m["model"], m.get("size", ""), level, how,
                             str(e.get("candidates", "")), str(e.get("measured", "")),
                             f"{e['wall_s']:.0f}"]
                            + [f"{t[k]:.0f}" if k in t else "" for k in SEARCH_STAGES]
                            + [_shipped_name(e), f"{best:.2f}"]
                            + [_ms(m.get("frameworks", {}).get(f)) for f in INTERLEAVED])
    head = (["model", "size", "levels", "measuring", "candidates", "distinct measured",
             "wall s"] + [f"{k} s" for k in SEARCH_STAGES] + ["shipped", "shipped ms"]
            + [f"interleaved: {f} ms" for f in INTERLEAVED])
    lines += machines + ["", "| " + " | ".join(head) + " |",
                         "|---|---|---|---|" + "---:|" * (3 + len(SEARCH_STAGES)) + "---|---:|"
                         + "---:|" * len(INTERLEAVED)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# The shipped build and the model file on each graph library, timed interleaved in one
# process after the search (``bench``'s frameworks).
INTERLEAVED = ("collage", "onnxruntime", "openvino")


def _ms(result, digits: int = 2) -> str:
    if not result or not math.isfinite(result.get("ms", math.nan)):
        return ""
    return f"{result['ms']:.{digits}f}" + ("" if result.get("match", True) else " (wrong)")


def _shipped_name(entry: dict) -> str:
    shipped = entry.get("shipped") or "collage"
    ops = entry.get("ops_per_backend") or {}
    if shipped == "collage" and ops:
        return "collage: " + ", ".join(f"{b} {n}" for b, n in sorted(ops.items()))
    return shipped


def call_tir_table(doc: dict) -> str:
    """The ``call_tir`` survey (``tools.call_tir_survey``): the machine and versions, then
    its two tables."""
    from . import call_tir_survey

    m = doc.get("machine") or {}
    versions = ", ".join(f"{k} {m[k]}" for k in ("tvm", "onnx", "torch") if m.get(k))
    return (f"{suites.machine_line(m).split(';')[0]}; {versions}\n\n"
            + call_tir_survey.table(doc) + "\n")


KINDS = {"deploy": deploy_table, "search-time": search_time_table,
         "torch-compile": torch_compile_table, "suite-table": lambda docs: suite_table(docs[0]),
         "suite-summary": suite_summary, "optimize-report": lambda docs: optimize_report(docs[0]),
         "call-tir-survey": lambda docs: call_tir_table(docs[0]), "gpu": gpu_table,
         "dynamic-suite": lambda docs: dynamic_suite_table(docs[0]),
         "int8-suite": lambda docs: int8_suite_table(docs[0]),
         "schedule-suite": lambda docs: schedule_suite_table(docs[0])}


def render_page(text: str, folder: Path) -> str:
    """``text`` with each rendered block's body rendered again from its results files."""

    def block(m):
        kind, *files = m.group("spec").split()
        if kind not in KINDS or not files:
            raise ValueError(f"rendered block {m.group('spec')!r}: expected one of "
                             f"{', '.join(KINDS)} and the results files it renders")
        return m.group(1) + KINDS[kind]([_load(folder, f) for f in files]) + m.group(4)

    return _BLOCK.sub(block, text)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m collage_tvm.tools.docs",
                                description="render the docs' tables from their results files")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 naming the pages rendering would change")
    p.add_argument("--docs", default=str(DOCS), help="the docs folder (default: this repo's)")
    args = p.parse_args(argv)
    folder, stale = Path(args.docs), []
    for page in PAGES:
        path = folder / page
        text = path.read_text()
        new = render_page(text, folder)
        if new != text:
            stale.append(page)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date with their results files: {', '.join(stale)} "
              "(python -m collage_tvm.tools.docs renders them)", file=sys.stderr)
        return 1
    print(("rendered: " + ", ".join(stale)) if stale else "every page is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
