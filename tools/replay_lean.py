"""Replay the lean search (``collage_tvm.placer.lean``) on a full-measure cost table.

    python tools/replay_lean.py MODEL.onnx COSTS.db [MODEL2.onnx COSTS2.db ...] -o out.json

Each cost DB must hold every candidate of its model, measured by a search with
``--no-lean`` (e.g. ``collage-tvm optimize M.onnx --no-lean --no-graph-level --no-compare
--refine 0 --calibrate 0 --db COSTS.db``). The replay hands ``lean_costs`` a stand-in
measurer that answers from the table (cutoffs applied), and writes, per model: the distinct
functions the lean loop timed, its DP answer against the full-measure one, and the least
share of its heavy operators' single times a measured region took, per backend.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os

from collage_tvm.byoc import candidate_vm_for
from collage_tvm.candidates import generate_candidates
from collage_tvm.measure.measurer import Measurer
from collage_tvm.options import SearchOptions
from collage_tvm.placer import lean
from collage_tvm.placer.op_level import ensure_cover, place
from collage_tvm.tools.bench import machine

build = importlib.import_module("collage_tvm.stages")  # the search, stage by stage


class TableMeasurer:
    """Answers from a full-measure cost table; counts the distinct functions asked for."""

    cutoff_factor = 4.0

    def __init__(self, table: dict, ident: dict):
        self.table, self.ident, self.asked = table, ident, set()

    def known(self, graph, candidates, backends):
        return {}

    def identities(self, graph, candidates, backends):
        return {c: self.ident[c] for c in candidates}

    def costs(self, graph, candidates, backends, cutoffs=None):
        self.asked |= {self.ident[c] for c in candidates}
        return {c: self.table[c] for c in candidates}


def replay(model: str, db: str) -> dict:
    opts = SearchOptions(progress=False)
    st = build.start(model, "llvm", opts, db=db)
    build.import_model(st)
    build.rewrite_graph(st)
    build.open_stores(st)
    graph, backends = st.graph, st.backends
    cands = generate_candidates(graph, backends.values())
    m = Measurer.from_options(st.target, st.cost_db, candidate_vm_for(None), opts)
    try:
        table = m.known(graph, cands, backends)
        ident = m.identities(graph, cands, backends)
        eps, switch = m.epsilon(backends.values()), m.switch_costs(backends.values())
    finally:
        m.close()
    missing = sum(1 for c in cands if c not in table)
    table = {c: table.get(c, math.inf) for c in cands}

    def dp(raw):
        est, _ = ensure_cover(len(graph), cands,
                              {c: max(0.0, v - eps[c.backend]) for c, v in raw.items()})
        return place(graph.producers, cands, est, eps, switch=switch).cost

    full = dp(table)
    stand_in = TableMeasurer(table, ident)
    raw, rep = lean.lean_costs(stand_in, graph, cands, backends, eps, switch)
    found = dp(raw)
    return {"model": os.path.basename(model), "candidates": len(cands), "distinct": len(set(ident.values())),
            "missing": missing, "full_ms": full, "lean_ms": found,
            "lean_over_full": found / full - 1.0, "timed": len(stand_in.asked),
            "rounds": rep.rounds, "stopped": rep.stopped,
            "least_share": _least_shares(graph, cands, table, eps)}


def _least_shares(graph, cands, table, eps) -> dict:
    """backend -> the least share of its heavy operators' single times a region of it took
    (``LowerBounds.least`` after every candidate of the table)."""
    bounds = lean.LowerBounds(graph, cands, eps)
    for c in cands:
        bounds.observe(c, table[c])
    return bounds.least


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="MODEL.onnx COSTS.db, repeated")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    if len(args.pairs) % 2:
        ap.error("give MODEL.onnx COSTS.db pairs")
    rows = [replay(m, d) for m, d in zip(args.pairs[::2], args.pairs[1::2])]
    with open(args.output, "w") as f:
        json.dump({"machine": machine(), "gap": lean.GAP, "parts_slack": lean.PARTS_SLACK,
                   "ratio_margin": lean.RATIO_MARGIN, "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['model']}: {r['timed']} of {r['distinct']} functions timed, lean "
              f"{r['lean_ms']:.3f} ms vs full {r['full_ms']:.3f} ms "
              f"({100 * r['lean_over_full']:+.2f}%), least shares {r['least_share']}")


if __name__ == "__main__":
    main()
