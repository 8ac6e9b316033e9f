"""Graph-level placer: evolutionary search over "offload to a graph library" (paper §4.3, Fig. 6).

The op-level placer judges candidates one kernel at a time, with additive costs. A
graph library (ONNX Runtime, OpenVINO) gains most from what additive costs cannot see:
fusing and planning across many kernels at once. This placer starts from the op-level
placement and asks, group by group, "would this run better inside a graph library,
merged with its offloaded neighbours into one library call?" and answers with measured
end-to-end latency.

Encoding (DEAP, bit genes so ``cxTwoPoint`` and ``mutFlipBit`` apply as in the paper):

* one *offload* bit per eligible op-level group (a group whose every node some registered
  graph library can run): 0 keeps the op-level choice, 1 offloads it. With one graph
  library, groups the op level already put on it are left out (as in the paper); with
  several they are eligible too, so the search also covers the choice between them;
* with several graph libraries, ``ceil(log2(L))`` *choice* bits per group select which
  one (a library that cannot run the group falls back to one that can).

Offloaded groups, and groups the op level already put on a graph library, that touch and
share the library are merged into one call whenever the union stays convex (no path leaves it and comes back), so the result is always an
executable placement. The population is seeded with the op-level placement (all 0) and
one all-offload individual per library; fitness is the measured latency of the built
placement, memoised on the decoded placement; an individual whose build fails or whose
outputs differ from the reference is invalid (infinite latency, reason logged) and the
search goes on. The search stops when the time budget is spent or the best latency has
not improved for ``patience`` generations (saturation).

A placement is not built when it cannot win (``call_ms``): each of its graph-library calls
takes at least that library's measured call overhead (the op level's epsilon), and
when their sum alone is ``BOUND_MARGIN`` times the best latency measured so far, the
placement is counted as bounded out, not built and timed. A model of a few tiny operators
(an onnx node test's microseconds, under one library call) measures only its seed.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from ..placement import Candidate, Placement, merge_offloaded, order_groups, valid_nodes

logger = logging.getLogger("collage_tvm")

# How far a placement's graph-library calls, at their call overheads alone, must be
# past the best latency measured for the placement to be left unbuilt: the overheads and
# the placements are timed apart (a busy moment can inflate one), so only a clear loss.
BOUND_MARGIN = 1.2


@dataclass
class GraphLevelResult:
    placement: Placement
    best_ms: float
    seed_ms: float                    # the op-level placement's measured latency
    history: list = field(default_factory=list)   # per generation: {"gen", "best_ms", "evaluated", "elapsed_s"}
    evaluated: int = 0                # distinct placements built and timed
    invalid: dict = field(default_factory=dict)   # decoded key -> reason
    stopped: str = ""                 # "budget" | "saturation" | "exhausted"
    bounded: int = 0                  # distinct placements not built: their calls' overheads lose


class GraphLevelSearch:
    """Set up once per (graph, op-level placement, graph libraries); ``run`` does the search."""

    def __init__(self, graph, placement: Placement, graph_libs: dict, evaluate: Callable,
                 order: Callable | None = None, seed: int = 0, call_ms: dict | None = None):
        """``graph_libs``: name -> Backend (kind ``graph``), each with pattern rules.
        ``evaluate(groups) -> (ms, reason)``: build and time a placement (inf + reason if invalid).
        ``order(graph, groups)``: an executable order of groups (default: ``order_groups``).
        ``call_ms``: library -> the least one call into it takes (ms; its measured call
        overhead): placements whose calls alone lose are not built (``lower_bound``).
        """
        order = order or order_groups
        self.graph, self.placement, self.evaluate, self.order = graph, placement, evaluate, order
        self.libs = sorted(graph_libs)
        self.valid = {name: valid_nodes(graph, graph_libs[name]) for name in self.libs}
        graph_names = set(self.libs)
        self.eligible = []  # (group index, [libs that can run it])
        self.on_lib = {k for k, g in enumerate(placement.groups) if g.backend in graph_names}
        for k, g in enumerate(placement.groups):
            if k in self.on_lib and len(self.libs) == 1:
                continue  # already on the graph library at the op level
            can = [lib for lib in self.libs if g.nodes <= self.valid[lib]]
            if can:
                self.eligible.append((k, can))
        self.choice_bits = max(0, math.ceil(math.log2(len(self.libs)))) if self.libs else 0
        self.rng = random.Random(seed)
        self.memo: dict = {}
        self.invalid: dict = {}
        self._warned: set = set()  # the reasons logged as warnings (``_log_invalid``)
        self.call_ms = {lib: ms for lib, ms in (call_ms or {}).items()
                        if lib in graph_libs and math.isfinite(ms) and ms > 0}
        self.bounded: dict = {}  # key -> lower bound (ms) of a placement left unbuilt

    @property
    def n_genes(self) -> int:
        return len(self.eligible) * (1 + self.choice_bits)

    def decode(self, genes) -> tuple:
        """(groups in executable order, {group: "op-level"|"graph-level"}) of an individual."""
        n = len(self.eligible)
        groups = list(self.placement.groups)
        offloaded = set()
        for pos, (k, can) in enumerate(self.eligible):
            if not genes[pos]:
                continue
            choice = 0
            for b in range(self.choice_bits):
                choice = choice * 2 + int(genes[n + pos * self.choice_bits + b])
            lib = self.libs[choice % len(self.libs)]
            if lib not in can:
                lib = can[0]
            groups[k] = Candidate(lib, groups[k].nodes, f"{lib}.graph")
            offloaded.add(k)
        if not offloaded:  # all 0: exactly the op-level placement
            return list(self.placement.groups), dict(self.placement.chosen_by)
        # Groups the op level put on a graph library join the merge (same library only).
        offloaded |= {k for k in self.on_lib if groups[k].backend in self.valid}
        merged = merge_offloaded(self.graph, groups, offloaded)
        chosen = {g: ("graph-level" if g.label.endswith(".graph") else
                      self.placement.chosen_by.get(g, "op-level")) for g in merged}
        return self.order(self.graph, merged), chosen

    @staticmethod
    def key(groups) -> frozenset:
        return frozenset((g.backend, g.nodes) for g in groups)

    def fitness(self, genes) -> float:
        try:
            groups = self.decode(genes)[0]
        except ValueError as e:  # no executable order: an invalid individual, not a crash
            key = frozenset(i for i, g in enumerate(genes) if g)
            self.invalid.setdefault(("genes", key), str(e))
            self._log_invalid(str(e))
            return math.inf
        return self.fitness_of(groups)

    def _log_invalid(self, reason: str) -> None:
        """A warning the first time a reason makes a placement invalid; the same reason
        again only in the debug log (GPT-2's graph level logged one reason for each of
        a dozen placements: the search's ``invalid`` keeps every one)."""
        if reason in self._warned:
            logger.debug("graph-level: placement invalid: %s", reason)
            return
        self._warned.add(reason)
        logger.warning("graph-level: placement invalid: %s", reason)

    def lower_bound(self, groups) -> float:
        """The least a placement can take: its graph-library calls at their call
        overheads (``call_ms``; 0 for a library without one), the rest at nothing."""
        return sum(self.call_ms.get(g.backend, 0.0) for g in groups)

    def known(self, key) -> bool:
        """Whether the placement of ``key`` was measured or bounded out already."""
        return key in self.memo or key in self.bounded

    def fitness_of(self, groups) -> float:
        """Measured latency of a placement (memoised; inf and a logged reason if invalid);
        its lower bound, unmeasured, when that alone is ``BOUND_MARGIN`` times the best
        latency measured so far."""
        key = self.key(groups)
        if key in self.bounded:
            return self.bounded[key]
        if key not in self.memo:
            best = min(self.memo.values(), default=math.inf)
            bound = self.lower_bound(groups)
            if bound > BOUND_MARGIN * best:
                self.bounded[key] = bound
                return bound
            ms, reason = self.evaluate(groups)
            self.memo[key] = ms
            if reason:
                self.invalid[key] = reason
                self._log_invalid(reason)
        return self.memo[key]

    def reachable(self, limit: int = 64) -> set | None:
        """The keys (``key``) of every placement the genes decode to; None when there are
        more than ``limit`` gene patterns to decode (the search itself is the way then)."""
        if self.n_genes > math.log2(limit):
            return None
        keys = set()
        for genes in itertools.product((0, 1), repeat=self.n_genes):
            try:
                keys.add(self.key(self.decode(list(genes))[0]))
            except ValueError:  # no executable order: nothing the search could ship
                continue
        return keys

    def seeds(self) -> list:
        n = len(self.eligible)
        out = [[0] * self.n_genes]
        for j, lib in enumerate(self.libs):
            bits = [int(c) for c in format(j, f"0{self.choice_bits}b")] if self.choice_bits else []
            out.append([1] * n + bits * n)
        return out

    def run(self, budget_s: float = 300.0, population: int = 12, patience: int = 5,
            cxpb: float = 0.6, mutpb: float = 0.4, immigrants: int = 2,
            max_generations: int = 1000,
            on_generation: Callable | None = None) -> GraphLevelResult:
        """The (mu + lambda) search: DEAP's ``varAnd`` variation, survival over distinct
        placements, a ``HallOfFame`` holding the best, stopped by the budget, by
        ``patience`` generations without a 0.1% gain, or when every placement was
        measured. DEAP's operators draw from the global ``random``: it is seeded from
        ``seed`` for the search and given back as it was."""
        t_start = time.perf_counter()
        seed_groups, _ = self.decode([0] * self.n_genes)
        result = GraphLevelResult(self.placement, math.inf, math.inf)
        if self.n_genes == 0:
            return self._merge_only(result, seed_groups, t_start)
        state = random.getstate()
        random.seed(self.rng.random())
        try:
            best = self._evolve(result, t_start, budget_s, population, patience, cxpb, mutpb,
                                immigrants, max_generations, on_generation)
        finally:
            random.setstate(state)
        result.seed_ms = self.memo[self.key(seed_groups)]
        groups, chosen = self.decode(best)
        result.best_ms = best.fitness.values[0]
        result.placement = Placement(groups, result.best_ms, chosen)
        result.evaluated = len(self.memo)
        result.bounded = len(self.bounded)
        result.invalid = dict(self.invalid)
        return result

    def _evolve(self, result, t_start, budget_s, population, patience, cxpb, mutpb,
                immigrants, max_generations, on_generation):
        """The generations; returns the best individual. Sets ``result.stopped``."""
        from deap import algorithms, tools

        toolbox, Individual = self._toolbox()

        def out_of_time() -> bool:
            return time.perf_counter() - t_start > budget_s

        def assess(pop) -> None:
            for ind in pop:
                if not ind.fitness.valid:
                    ind.fitness.values = (math.inf,) if out_of_time() and \
                        not self.known(self.key(self.decode(ind)[0])) else (self.fitness(ind),)

        pop = [Individual(s) for s in self.seeds()]
        while len(pop) < population:
            pop.append(self._random(Individual))
        assess(pop)
        fame = tools.HallOfFame(1)
        fame.update(pop)
        stats = tools.Statistics(lambda ind: ind.fitness.values[0])
        stats.register("best_ms", min)
        stale, gen = 0, 0
        self._record(result, gen, stats.compile(pop), t_start, on_generation)
        while not self._stop(result, out_of_time(), stale >= patience, gen >= max_generations):
            gen += 1
            offspring = algorithms.varAnd(toolbox.select(pop, population), toolbox, cxpb, mutpb)
            for ind in offspring:
                # Every evaluation costs a build and a timing run: an offspring that decodes
                # to a placement already measured is mutated again (a few tries).
                for _ in range(3):
                    if not self.known(self.key(self.decode(ind)[0])):
                        break
                    toolbox.mutate(ind)
                    del ind.fitness.values
            # Fresh random individuals keep the population from collapsing onto one
            # placement (on a dozen individuals a GA converges fast).
            for k in range(1, min(immigrants, len(offspring)) + 1):
                offspring[-k] = self._random(Individual)
            assess(offspring)
            # (mu + lambda) survival over distinct placements: parents compete with their
            # offspring, so a good runner-up (e.g. the other library's seed) is not lost.
            pop = self._distinct_best(pop + offspring, population)
            before = fame[0].fitness.values[0]
            fame.update(pop)
            stale = 0 if fame[0].fitness.values[0] < before * (1 - 1e-3) else stale + 1
            self._record(result, gen, stats.compile(pop), t_start, on_generation)
        return fame[0]

    def _toolbox(self):
        """DEAP's toolbox as the paper uses it: two-point crossover, bit-flip mutation,
        tournament selection; minimising latency."""
        from deap import base, creator, tools

        if not hasattr(creator, "CollageFitnessMin"):
            creator.create("CollageFitnessMin", base.Fitness, weights=(-1.0,))
            creator.create("CollageIndividual", list, fitness=creator.CollageFitnessMin)
        toolbox = base.Toolbox()
        toolbox.register("mate", tools.cxTwoPoint)
        toolbox.register("mutate", tools.mutFlipBit, indpb=max(2.0 / max(self.n_genes, 1), 0.02))
        toolbox.register("select", tools.selTournament, tournsize=3)
        return toolbox, creator.CollageIndividual

    def _random(self, Individual):
        return Individual(self.rng.randint(0, 1) for _ in range(self.n_genes))

    def _stop(self, result, out_of_time: bool, saturated: bool, last_gen: bool) -> bool:
        if out_of_time:
            result.stopped = "budget"
        elif saturated:
            result.stopped = "saturation"
        elif last_gen or len(self.memo) + len(self.bounded) >= self._distinct_placements():
            result.stopped = "exhausted"
        return bool(result.stopped)

    def _distinct_placements(self) -> int:
        """At most this many distinct placements decode from the genes: each eligible group
        stays or goes to one of the libraries that can run it (more gene patterns than
        that decode alike: a one-operator graph on two libraries has 4 and 3 placements)."""
        return min(2 ** min(self.n_genes, 60),
                   math.prod(1 + len(can) for _, can in self.eligible))

    def _merge_only(self, result, seed_groups, t_start) -> GraphLevelResult:
        """No gene to search. With groups on graph libraries already, the one choice left
        is whether their touching calls run merged (fewer, larger library calls)."""
        result.stopped = "exhausted"
        if len(self.on_lib) < 2:
            logger.info("graph-level: no op-level group can run on a graph library; "
                        "nothing to search")
            return result
        merged = merge_offloaded(self.graph, list(self.placement.groups), set(self.on_lib))
        result.seed_ms = self.fitness_of(seed_groups)
        merged_ms = self.fitness_of(self.order(self.graph, merged))
        result.evaluated = len(self.memo)
        result.invalid = dict(self.invalid)
        if merged_ms < result.seed_ms:
            chosen = {g: ("graph-level" if g.label.endswith(".graph") else
                          self.placement.chosen_by.get(g, "op-level")) for g in merged}
            result.placement = Placement(self.order(self.graph, merged), merged_ms, chosen)
        result.best_ms = min(merged_ms, result.seed_ms)
        result.history.append({"gen": 0, "best_ms": result.best_ms,
                               "evaluated": result.evaluated,
                               "elapsed_s": time.perf_counter() - t_start})
        logger.info("graph-level: every eligible group is on its library already; its "
                    "calls merged: %.3f ms, as placed: %.3f ms", merged_ms, result.seed_ms)
        return result

    def _distinct_best(self, individuals, n) -> list:
        out, seen = [], set()
        for ind in sorted(individuals, key=lambda i: i.fitness.values[0]):
            key = self.key(self.decode(ind)[0])
            if key not in seen:
                seen.add(key)
                out.append(ind)
            if len(out) == n:
                break
        return out

    def _record(self, result, gen, stats: dict, t_start, on_generation) -> None:
        entry = {"gen": gen, "best_ms": stats["best_ms"], "evaluated": len(self.memo),
                 "elapsed_s": time.perf_counter() - t_start}
        result.history.append(entry)
        logger.info("graph-level gen %d: best %.3f ms (%d placements measured, %.0f s)",
                    gen, entry["best_ms"], entry["evaluated"], entry["elapsed_s"])
        if on_generation is not None:
            on_generation(entry)
