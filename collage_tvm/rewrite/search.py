"""Cost-based backtracking search over rewrites (MetaFlow Alg. 1, TASO Alg. 2).

A priority queue of graphs by cost, cheapest first. Each graph popped is expanded by every
substitution at every site; a new graph (by structural hash) is queued when its cost is
below ``alpha`` times the best so far, so rewrites that cost a little now but open a
cheaper graph later are still explored (alpha 1.05 as in MetaFlow). Stops when the queue is
empty, ``budget_s`` has passed or ``max_graphs`` graphs were costed.

``cost(mod) -> float`` is the caller's: the build passes a cost from measured per-candidate
costs of the backends that will run the graph (so a rewrite is judged on those backends);
the tests pass a fake table.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from tvm_ffi.structural import structural_hash

from .passes import (fold_conv_affine, fold_conv_affine_sites, merge_sibling_convs,
                     sibling_conv_sites)


@dataclass(frozen=True)
class Rewrite:
    """A substitution as the search applies it: ``sites(mod)`` lists where it applies,
    ``apply(mod, site)`` returns the rewritten module."""
    name: str
    sites: object
    apply: object


REWRITES = (
    Rewrite("fold_conv_affine", fold_conv_affine_sites, lambda mod, _site: fold_conv_affine(mod)),
    Rewrite("merge_sibling_convs", sibling_conv_sites, merge_sibling_convs),
)


@dataclass
class SearchResult:
    module: object
    cost: float
    start_cost: float
    applied: list = field(default_factory=list)     # names of the rewrites on the best path
    graphs: int = 0                                  # graphs costed
    pruned: int = 0                                  # new graphs not queued (cost >= alpha*best)
    seconds: float = 0.0
    stopped: str = "queue empty"


def search(mod, cost, rewrites=REWRITES, alpha: float = 1.05, budget_s: float = 60.0,
           max_graphs: int = 500, min_gain: float = 0.0) -> SearchResult:
    """The best module found from ``mod`` (see the module doc); ``mod`` itself unless the
    best costs at least ``min_gain`` (a fraction) less: measured costs carry noise, and a
    rewrite that gains less than it is no gain."""
    t0 = time.perf_counter()
    start = cost(mod)
    best, best_cost, best_path = mod, start, []
    tie = itertools.count()
    queue = [(start, next(tie), mod, [])]
    seen = {structural_hash(mod)}
    result = SearchResult(mod, start, start, graphs=1)
    while queue:
        if time.perf_counter() - t0 > budget_s:
            result.stopped = "budget"
            break
        c, _, g, path = heapq.heappop(queue)
        if c < best_cost:
            best, best_cost, best_path = g, c, path
        for rw in rewrites:
            for site in rw.sites(g):
                new = rw.apply(g, site)
                h = structural_hash(new)
                if h in seen:
                    continue
                seen.add(h)
                if result.graphs >= max_graphs:
                    result.stopped = "max_graphs"
                    queue = []
                    break
                new_cost = cost(new)
                result.graphs += 1
                if new_cost < alpha * best_cost:
                    heapq.heappush(queue, (new_cost, next(tie), new, path + [rw.name]))
                    if new_cost < best_cost:
                        best, best_cost, best_path = new, new_cost, path + [rw.name]
                else:
                    result.pruned += 1
    if best_cost > start * (1.0 - min_gain):
        best, best_cost, best_path = mod, start, []
    result.module, result.cost, result.applied = best, best_cost, best_path
    result.seconds = time.perf_counter() - t0
    return result
