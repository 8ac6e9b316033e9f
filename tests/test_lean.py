"""Measuring only what can win (issue #35, ``placer.lean``): on a fake cost table whose
costs keep to a roofline, the DP on lower bounds measures a fraction of the candidates and finds
the placement the full-measure DP finds; a skipped candidate could not have won."""
import math

import numpy as np
import pytest
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.measure.estimate import Roofline, node_flops, work
from collage_tvm.candidates import generate_candidates
from collage_tvm.placer.lean import LowerBounds, lean_costs
from collage_tvm.placer.op_level import place
from collage_tvm.registry import get_backend

_RNG = np.random.default_rng(0)


def _const(*shape):
    return relax.const(_RNG.normal(0, 0.1, shape).astype("float32"))


def _graph(blocks: int = 4):
    """Conv -> bias -> relu blocks and a matmul head: convolutions, elementwise, a GEMM."""
    x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = x
            for _ in range(blocks):
                h = bb.emit(relax.op.nn.conv2d(h, _const(8, 8, 3, 3), padding=1))
                h = bb.emit(relax.op.add(h, _const(1, 8, 1, 1)))
                h = bb.emit(relax.op.nn.relu(h))
            h = bb.emit(relax.op.reshape(h, (1, 2048)))
            out = bb.emit_output(relax.op.matmul(h, _const(2048, 10)))
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


def _problem(blocks: int = 4) -> tuple:
    """(graph, backends, candidates, cost table) of ``_graph(blocks)`` on ``EPS``'s backends."""
    graph = _graph(blocks)
    backends = {n: get_backend(n) for n in EPS}
    candidates = generate_candidates(graph, backends.values())
    return graph, backends, candidates, _table(graph, candidates)


class FakeMeasurer:
    """Costs from a table; counts what was asked for."""

    def __init__(self, table):
        self.table, self.asked, self.cutoffs = table, [], {}
        self.cutoff_factor = 4.0

    def known(self, graph, candidates, backends):
        return {}

    def costs(self, graph, candidates, backends, cutoffs=None):
        self.cutoffs.update(cutoffs or {})
        self.asked += candidates
        return {c: self.table[c] for c in candidates}


EPS = {"tvm": 0.002, "dnnl": 0.004, "onnxruntime": 0.01}
RATE = {"tvm": (2e6, 4e6), "dnnl": (8e6, 6e6), "onnxruntime": (6e6, 8e6)}  # FLOP/ms, bytes/ms


def _table(graph, candidates):
    """Each candidate's cost: its roofline at its backend's rates, slowed by a factor in
    [1, 2) (a kernel never beats its backend's best rate), plus the call's overhead."""
    rng = np.random.default_rng(1)
    table = {}
    for c in candidates:
        flops, moved = work(graph, c.nodes)
        pf, pb = RATE[c.backend]
        table[c] = EPS[c.backend] + max(flops / pf, moved / pb) * rng.uniform(1.0, 2.0)
    return table


def test_the_dp_on_lower_bounds_finds_the_full_measure_placement_measuring_a_fraction():
    graph, backends, candidates, table = _problem()
    fake = FakeMeasurer(table)
    raw, rep = lean_costs(fake, graph, candidates, backends, EPS, switch={}, gap=None)
    full = place(graph.producers, candidates,
                 {c: max(0.0, v - EPS[c.backend]) for c, v in table.items()}, EPS)
    lean = place(graph.producers, candidates,
                 {c: max(0.0, v - EPS[c.backend]) for c, v in raw.items()}, EPS)
    assert math.isclose(lean.cost, full.cost, rel_tol=1e-9), (lean.groups, full.groups)
    assert rep.skipped > 0 and rep.measured + rep.skipped == len(candidates)
    assert len(set(fake.asked)) == rep.measured < len(candidates)
    assert all(g in fake.asked for g in lean.groups)  # every chosen candidate measured
    skipped = [c for c in candidates if c not in fake.asked]
    assert skipped and all(raw[c] == math.inf for c in skipped)
    assert rep.bounds_broken == 0


def _forced_costs(graph, candidates, table, found_raw, gap):
    """Forcing any one skipped candidate into the cover (its true cost from the table):
    the cheapest such cover, per skipped candidate."""
    out = {}
    skipped = [c for c in candidates if found_raw[c] == math.inf]
    for c in skipped[:40]:
        overlapping = {o for o in candidates if o != c and o.nodes & c.nodes}
        costs = {o: (math.inf if o in overlapping else max(0.0, table[o] - EPS[o.backend]))
                 for o in candidates}
        try:
            out[c] = place(graph.producers, candidates, costs, EPS).cost
        except ValueError:  # no executable cover contains it
            continue
    return skipped, out


@pytest.mark.parametrize("gap", [None, 0.2])
def test_a_skipped_candidate_could_not_have_won(gap):
    # Without a gap, forcing any one skipped candidate into the cover never beats the
    # placement found: its lower bound had already lost to measured costs. With one, it beats it
    # by less than the gap.
    graph, backends, candidates, table = _problem(blocks=2)
    fake = FakeMeasurer(table)
    raw, rep = lean_costs(fake, graph, candidates, backends, EPS, switch={}, gap=gap)
    found = place(graph.producers, candidates,
                  {c: max(0.0, v - EPS[c.backend]) for c, v in raw.items()}, EPS).cost
    assert math.isclose(found, rep.upper_ms, rel_tol=1e-9)
    assert rep.upper_ms <= (1 + (gap or 0.0)) * rep.lower_ms + 1e-12
    skipped, forced = _forced_costs(graph, candidates, table, raw, gap)
    assert skipped and forced
    for c, cost in forced.items():
        assert cost * (1 + (gap or 0.0)) >= found - 1e-12, c


def test_the_gap_measures_less_and_stays_within_it_of_the_full_measure_answer():
    graph, backends, candidates, table = _problem(blocks=6)
    full = place(graph.producers, candidates,
                 {c: max(0.0, v - EPS[c.backend]) for c, v in table.items()}, EPS).cost
    asked = {}
    for gap in (None, 0.3):
        fake = FakeMeasurer(table)
        raw, rep = lean_costs(fake, graph, candidates, backends, EPS, switch={}, gap=gap)
        asked[gap] = len(set(fake.asked))
        found = place(graph.producers, candidates,
                      {c: max(0.0, v - EPS[c.backend]) for c, v in raw.items()}, EPS).cost
        assert full - 1e-12 <= found <= (1 + (gap or 0.0)) * full + 1e-12
        assert rep.stopped in ("measured", "gap")
    assert asked[0.3] <= asked[None]


def test_the_single_heavy_operators_are_measured_first_and_bound_their_groups():
    graph, backends, candidates, table = _problem(blocks=2)
    bounds = LowerBounds(graph, candidates, EPS)
    seed = bounds.singles_of_heavy(candidates)
    assert seed and all(len(c.nodes) == 1 for c in seed)
    assert {graph.nodes[next(iter(c.nodes))].op_name for c in seed} <= {
        "relax.nn.conv2d", "relax.matmul"}
    conv = next(c for c in seed if c.backend == "dnnl"
                and graph.nodes[next(iter(c.nodes))].op_name == "relax.nn.conv2d")
    fused = [c for c in candidates if c.backend == "dnnl" and conv.nodes < c.nodes]
    assert fused
    before = bounds.bound(fused[0])
    bounds.observe(conv, EPS["dnnl"] + 1.0)  # the convolution alone: 1 ms
    assert bounds.bound(fused[0]) >= max(before, 0.7 - 1e-12)  # PARTS_SLACK of its heavy part
    fake = FakeMeasurer(table)
    _, rep = lean_costs(fake, graph, candidates, backends, EPS, switch={})
    external = [c for c in seed if backends[c.backend].is_external]
    largest = bounds.largest(candidates, backends)  # onnxruntime's whole-graph region
    assert largest and {c.backend for c in largest} == {"onnxruntime"}
    assert len(largest[0].nodes) == max(len(c.nodes) for c in candidates
                                        if c.backend == "onnxruntime")
    assert rep.seeded == len(external) + len(largest)
    assert fake.asked[:rep.seeded] == external + largest


def test_a_group_measured_below_its_parts_lowers_its_backend_s_share():
    # MobileNetV2 on OpenVINO: a region of depthwise convolutions ran in 0.16 of their times
    # alone. The lower bounds of that backend's groups follow what its groups were measured at.
    graph, backends, candidates, _ = _problem(blocks=2)
    bounds = LowerBounds(graph, candidates, EPS)
    region = max((c for c in candidates if c.backend == "onnxruntime"), key=lambda c: len(c.nodes))
    heavy = bounds.heavy[region]
    for i in heavy:
        single = next(c for c in candidates if c.backend == "onnxruntime" and c.nodes == {i})
        bounds.observe(single, EPS["onnxruntime"] + 1.0)  # 1 ms each alone
    assert math.isclose(bounds.bound(region), 0.7 * len(heavy))
    bounds.observe(region, EPS["onnxruntime"] + 0.2 * len(heavy))  # the region: 0.2 of them
    assert math.isclose(bounds.share["onnxruntime"], 0.8 * 0.2)
    assert math.isclose(bounds.bound(region), 0.16 * len(heavy))
    assert "dnnl" not in bounds.share  # another backend keeps its share


def test_the_work_of_a_convolution_and_the_lower_bound_of_an_unseen_backend():
    graph = _graph(blocks=1)
    conv = next(n for n in graph.nodes if n.op_name == "relax.nn.conv2d")
    assert node_flops(conv) == 2 * (8 * 16 * 16) * (8 * 3 * 3)
    flops, moved = work(graph, [conv.index])
    assert flops == node_flops(conv) and moved == 4 * (8 * 16 * 16 * 2 + 8 * 8 * 3 * 3)
    roof = Roofline(slack=0.5)
    assert roof.bound("dnnl", flops, moved) == 0.0  # never measured: the DP tries it
    roof.observe("dnnl", flops, moved, 0.01)
    assert roof.bound("dnnl", flops, moved) == 0.005  # half its own time: the slack
    assert roof.bound("dnnl", 2 * flops, moved) == 0.01


def test_a_candidate_measured_after_the_single_operators_gets_a_cutoff_from_them():
    # A TVM kernel whose first run is four times what the same heavy operators take alone on
    # the best library cannot win: its timing is cut short (Measurer.costs' cutoffs).
    graph, backends, candidates, table = _problem(blocks=3)
    fake = FakeMeasurer(table)
    lean_costs(fake, graph, candidates, backends, EPS, switch={}, gap=None)
    seeded = [c for c in fake.asked if len(c.nodes) == 1 and c.backend != "tvm"]
    assert fake.cutoffs and not set(fake.cutoffs) & set(seeded)
    for c, cut in fake.cutoffs.items():
        heavy = [i for i in c.nodes if graph.nodes[i].op_name in ("relax.nn.conv2d", "relax.matmul")]
        best = sum(min(table[s] - EPS[s.backend] for s in seeded if s.nodes == {i})
                   for i in heavy)
        assert math.isclose(cut, 4.0 * (best + EPS[c.backend]), rel_tol=1e-9), c


def test_a_lib_plus_tvm_build_doing_tvm_only_s_work_is_not_built_when_tvm_only_was_hopeless():
    # The final check: tvm-only timed once past the cutoff; "mkl+tvm" with MKL's matmul only
    # leaves the convolutions on TVM, so it cannot beat the cutoff: not built. One with the
    # convolutions on a library is built.
    from collage_tvm.check.contender import from_records
    from collage_tvm.check.never_slower import _hopeless_like_tvm_only as like_tvm_only
    from collage_tvm.options import FinalCheck
    from collage_tvm.placement import Candidate

    def _hopeless_like_tvm_only(graph, groups, results, cutoff):
        return like_tvm_only(graph, groups, from_records(results), cutoff, FinalCheck())

    graph = _graph(blocks=2)
    matmul = next(n.index for n in graph.nodes if n.op_name == "relax.matmul")
    convs = {n.index for n in graph.nodes if n.op_name == "relax.nn.conv2d"}
    rest = frozenset(range(len(graph))) - {matmul}
    mkl = [Candidate("tvm", rest, "tvm"), Candidate("mkl", frozenset([matmul]), "mkl")]
    dnnl = [Candidate("tvm", rest - convs, "tvm"), Candidate("dnnl", frozenset(convs), "dnnl"),
            Candidate("tvm", frozenset([matmul]), "tvm")]
    hopeless = {"tvm-only": {"ms": 500.0, "timed_once": True}}
    why = _hopeless_like_tvm_only(graph, mkl, hopeless, cutoff=40.0)
    assert why and "FLOPs" in why
    assert _hopeless_like_tvm_only(graph, dnnl, hopeless, cutoff=40.0) is None
    timed = {"tvm-only": {"ms": 500.0}}  # tvm-only was timed in full: build them all
    assert _hopeless_like_tvm_only(graph, mkl, timed, cutoff=40.0) is None
    # tvm-only itself not built (its floor was past the cutoff): the floor is the rate.
    unbuilt = {"tvm-only": {"ms": math.inf, "skipped": True, "floor_ms": 500.0}}
    assert "FLOPs" in _hopeless_like_tvm_only(graph, mkl, unbuilt, cutoff=40.0)


def test_what_tvm_alone_takes_at_least_is_below_what_it_takes():
    # The DP over TVM's candidates alone (and over an op library's with TVM's), on measured
    # costs and lower bounds: a lower bound of the full-measure single-backend placement
    # (the roofline keeps to its lower bounds here); the final check skips building one only past
    # ALONE_FACTOR times the placement's first time.
    from collage_tvm.check.never_slower import _hopeless_by_estimate as hopeless
    from collage_tvm.options import FinalCheck

    s = FinalCheck()
    ALONE_FACTOR, ALONE_MIN_MS, SLOW_BUILD_FACTOR = (s.alone_factor, s.alone_min_ms,
                                                     s.slow_build_factor)

    def _hopeless_by_estimate(estimate, cutoff):
        return hopeless(estimate, cutoff, s)


    graph, backends, candidates, table = _problem(blocks=3)
    raw, rep = lean_costs(FakeMeasurer(table), graph, candidates, backends, EPS, switch={})
    for build, names in (("tvm-only", ("tvm",)), ("dnnl+tvm", ("dnnl", "tvm"))):
        mine = [c for c in candidates if c.backend in names]
        full = place(graph.producers, mine,
                     {c: max(0.0, table[c] - EPS[c.backend]) for c in mine}, EPS).cost
        assert 0 < rep.alone_ms[build] <= full + 1e-12, build
    assert rep.alone_ms["tvm-only"] == rep.tvm_alone_ms
    assert set(rep.alone_ms) == {"tvm-only", "dnnl+tvm"}  # onnxruntime: a graph library
    est = max(rep.tvm_alone_ms, 2 * ALONE_MIN_MS)  # (the fake table's ms are tiny)
    first = est / ALONE_FACTOR  # the placement's first time; the cutoff is 10x it
    assert _hopeless_by_estimate(est, cutoff=SLOW_BUILD_FACTOR * first * 0.99)
    assert _hopeless_by_estimate(est, cutoff=SLOW_BUILD_FACTOR * first * 1.01) is None
    assert _hopeless_by_estimate(math.inf, cutoff=1.0) is None  # no cover: unknown, built
    assert _hopeless_by_estimate(est, cutoff=None) is None  # collage failed
    assert _hopeless_by_estimate(None, cutoff=1.0) is None  # no estimate (--no-lean)
    # a build estimated under ALONE_MIN_MS is built whatever the ratio
    assert _hopeless_by_estimate(0.9 * ALONE_MIN_MS, cutoff=1e-6) is None


def test_tvm_far_slower_than_the_libraries_is_measured_a_few_times_not_everywhere(monkeypatch):
    # Untuned TVM: its convolutions at a fiftieth of its rates, its matrix product at four
    # times them (as fast as a library's: the roofline's peak, halved, keeps the lower bounds
    # of its convolutions low). Two of its convolution groups are measured first; against the
    # libraries' single operators they give the rest a lower bound from that ratio, and those are
    # skipped; without it they are offered on.
    import collage_tvm.placer.lean as lean

    graph, backends, candidates, table = _problem(blocks=6)
    for c in candidates:
        ops = {graph.nodes[i].op_name for i in c.nodes}
        if c.backend == "tvm" and "relax.nn.conv2d" in ops:
            table[c] = EPS["tvm"] + 50 * (table[c] - EPS["tvm"])
        elif c.backend == "tvm" and "relax.matmul" in ops:
            table[c] = EPS["tvm"] + (table[c] - EPS["tvm"]) / 4
    full = place(graph.producers, candidates,
                 {c: max(0.0, v - EPS[c.backend]) for c, v in table.items()}, EPS).cost

    def tvm_measured():
        fake = FakeMeasurer(table)
        raw, rep = lean_costs(fake, graph, candidates, backends, EPS, switch={}, gap=None)
        found = place(graph.producers, candidates,
                      {c: max(0.0, v - EPS[c.backend]) for c, v in raw.items()}, EPS).cost
        assert math.isclose(found, full, rel_tol=1e-9)
        return sum(1 for c in set(fake.asked) if c.backend == "tvm")

    with_ratio = tvm_measured()
    monkeypatch.setattr(lean.LowerBounds, "relative_bound", lambda self, c: 0.0)
    assert with_ratio < tvm_measured()


def test_a_rerun_over_the_same_cost_db_takes_the_kept_verdict_and_measures_nothing(tmp_path):
    # The real Measurer's verdict in a real cost DB; its costs from the table. The second
    # search's DB knows more than the first measured (as a carved region adds): asked again
    # on the lower bounds those costs lower, the DP could want more measured; the kept verdict
    # stands instead. With a measured candidate forgotten (a failure of the moment), the
    # verdict does not stand and the search measures again.
    from collage_tvm.byoc import candidate_vm
    from collage_tvm.measure.db import CostDB
    from collage_tvm.measure.keys import LEAN_KEY
    from collage_tvm.measure.measurer import Measurer
    from collage_tvm.target import make_target

    graph, backends, candidates, table = _problem(blocks=6)

    class TableMeasurer(Measurer):
        def __init__(self, db, known):
            super().__init__(make_target("llvm"), db, candidate_vm, isolate=False,
                             progress=False)
            self.asked, self.table_known = [], known

        def known(self, graph, candidates, backends):
            return {c: table[c] for c in candidates if c in self.table_known}

        def costs(self, graph, candidates, backends, cutoffs=None):
            self.asked += candidates
            return {c: table[c] for c in candidates}

    db = CostDB(str(tmp_path / "c.db"))
    first = TableMeasurer(db, set())
    raw, rep = lean_costs(first, graph, candidates, backends, EPS, switch={}, gap=0.3)
    first.close()
    measured = {c for c in candidates if math.isfinite(raw[c])}
    assert rep.skipped > 0 and any(r["key"].startswith(LEAN_KEY) for r in db.rows())
    extra = {c for c in candidates if c not in measured and len(c.nodes) > 1}
    assert extra
    again = TableMeasurer(db, measured | set(list(extra)[:3]))
    raw2, rep2 = lean_costs(again, graph, candidates, backends, EPS, switch={}, gap=0.3)
    again.close()
    assert again.asked == [] and rep2.stopped == "db" and rep2.measured == 0
    assert all(raw2[c] == table[c] for c in measured)  # the DB's costs
    # Forgotten: a group of the placement chosen (every lean search measures those; an
    # arbitrary measured candidate the DP may never need again: the set's order, and so
    # this test, then varied with the hash seed)
    chosen = place(graph.producers, candidates,
                   {c: max(0.0, v - EPS[c.backend]) for c, v in raw.items()}, EPS).groups
    forgot = min((c for c in chosen if c in measured), key=lambda c: (min(c.nodes), c.backend))
    third = TableMeasurer(db, measured - {forgot})
    _, rep3 = lean_costs(third, graph, candidates, backends, EPS, switch={}, gap=0.3)
    third.close()
    assert forgot in third.asked and rep3.stopped in ("measured", "gap")
