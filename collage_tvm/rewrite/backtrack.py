"""Cost-based backtracking search over rewrites (MetaFlow Alg. 1, TASO Alg. 2).

A priority queue of graphs by cost, cheapest first. Each graph popped is expanded by every
substitution at every site; a new graph (by structural hash) is queued when its cost is
below ``alpha`` times the best so far, so rewrites that cost a little now but open a
cheaper graph later are still explored (alpha 1.05 as in MetaFlow). Stops when the queue is
empty, ``max_graphs`` graphs were costed, or the next costing would end past ``budget_s``
(the mean time of the costings so far is what is left to fit).

A graph no cheaper than the best is queued only when it has a site its parent lacked (the
rewrite opened one: a wider conv with a third sibling, a fold made possible): a rewrite
that opens nothing can only be combined with the parent's other sites, and the parent's
expansion tries those. Without this, k independent rewrites that each change the cost by
less than alpha queue all 2^k combinations (inception_v3's sibling merges).

``cost(mod) -> float`` is the caller's: the build passes a cost from measured per-candidate
costs of the backends that will run the graph (so a rewrite is judged on those backends);
the tests pass a fake table.

``split_backtrack`` is the search over a graph split into pieces (``split``, MetaFlow Alg. 2):
each piece searched alone (only the sites inside it), in order, each from the result of
the one before; then the sites that span pieces, from the stitched graph.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from tvm_ffi.structural import structural_hash

from .passes import (_single_block, concat_conv_sites, fold_conv_affine,
                     fold_conv_affine_sites, merge_sibling_convs, merge_sibling_matmuls,
                     sibling_conv_sites, sibling_matmul_sites, split_conv_over_concat)


def _whole_graph(_mod, _site):
    return None


def _binding_vars(mod, site) -> list:
    bindings = _single_block(mod)
    return [bindings[k].var for k in site]


def _conv_and_input(mod, site) -> list:
    conv = _single_block(mod)[site]
    return [conv.var, conv.value.args[0]]


@dataclass(frozen=True)
class Rewrite:
    """A substitution as the search applies it: ``sites(mod)`` lists where it applies,
    ``apply(mod, site)`` returns the rewritten module, ``site_vars(mod, site)`` the vars of
    the bindings the site rewrites (None: the whole graph)."""
    name: str
    sites: object
    apply: object
    site_vars: object = _whole_graph


REWRITES = (
    Rewrite("fold_conv_affine", fold_conv_affine_sites, lambda mod, _site: fold_conv_affine(mod)),
    Rewrite("merge_sibling_convs", sibling_conv_sites, merge_sibling_convs, _binding_vars),
    Rewrite("split_conv_over_concat", concat_conv_sites, split_conv_over_concat,
            _conv_and_input),
    Rewrite("merge_sibling_matmuls", sibling_matmul_sites, merge_sibling_matmuls,
            _binding_vars),
)


@dataclass
class RewriteResult:
    module: object
    cost: float
    start_cost: float
    applied: list = field(default_factory=list)     # names of the rewrites on the best path
    graphs: int = 0                                  # graphs costed
    pruned: int = 0                                  # new graphs not queued (cost >= alpha*best)
    closed: int = 0                                  # not queued: no cheaper, no new site
    seconds: float = 0.0
    stopped: str = "queue empty"
    pieces: list = field(default_factory=list)      # split_backtrack: sizes of the pieces


def backtrack(mod, cost, rewrites=REWRITES, alpha: float = 1.05, budget_s: float = 60.0,
           max_graphs: int = 500, min_gain: float = 0.0, allowed=None,
           start_cost: float | None = None, min_gain_ms: float = 0.0) -> RewriteResult:
    """The best module found from ``mod`` (see the module doc); ``mod`` itself unless the
    best costs at least ``min_gain`` (a fraction) and ``min_gain_ms`` less: measured costs
    carry noise, and a rewrite that gains less than it is no gain. ``allowed(rewrite, mod,
    site)``: which sites to try (default all); ``start_cost``: ``cost(mod)`` if known."""
    t0 = time.perf_counter()
    start = cost(mod) if start_cost is None else start_cost
    best, best_cost, best_path = mod, start, []
    tie = itertools.count()

    def sites_of(g) -> list:
        return [(rw, site) for rw in rewrites for site in rw.sites(g)
                if allowed is None or allowed(rw, g, site)]

    def keys(g, sites) -> set:
        return {(rw.name, None if (v := rw.site_vars(g, site)) is None else tuple(v))
                for rw, site in sites}

    queue = [(start, next(tie), mod, [], None)]
    seen = {structural_hash(mod)}
    result = RewriteResult(mod, start, start, graphs=1)
    costing = []  # seconds each costing took: the next is not started unless one fits

    def out_of_time() -> bool:
        mean = sum(costing) / len(costing) if costing else 0.0
        return time.perf_counter() - t0 + mean > budget_s

    while queue:
        if out_of_time():
            result.stopped = "budget"
            break
        c, _, g, path, g_sites = heapq.heappop(queue)
        if c < best_cost:
            best, best_cost, best_path = g, c, path
        g_sites = sites_of(g) if g_sites is None else g_sites
        g_keys = None
        for rw, site in g_sites:
            if out_of_time():  # a graph may have many sites
                result.stopped = "budget"
                queue = []
                break
            new = rw.apply(g, site)
            h = structural_hash(new)
            if h in seen:
                continue
            seen.add(h)
            if result.graphs >= max_graphs:
                result.stopped = "max_graphs"
                queue = []
                break
            t_cost = time.perf_counter()
            new_cost = cost(new)
            costing.append(time.perf_counter() - t_cost)
            result.graphs += 1
            if new_cost >= alpha * best_cost:
                result.pruned += 1
                continue
            new_sites = None
            if new_cost >= best_cost:
                new_sites = sites_of(new)
                g_keys = keys(g, g_sites) if g_keys is None else g_keys
                if keys(new, new_sites) <= g_keys:
                    result.closed += 1
                    continue
            heapq.heappush(queue, (new_cost, next(tie), new, path + [rw.name], new_sites))
            if new_cost < best_cost:
                best, best_cost, best_path = new, new_cost, path + [rw.name]
    if best_cost > start * (1.0 - min_gain) or best_cost > start - min_gain_ms:
        best, best_cost, best_path = mod, start, []
    result.module, result.cost, result.applied = best, best_cost, best_path
    result.seconds = time.perf_counter() - t0
    return result


def split_backtrack(mod, cost, rewrites=REWRITES, max_ops: int = 30, alpha: float = 1.05,
                 budget_s: float = 60.0, max_graphs: int = 500,
                 min_gain: float = 0.0) -> RewriteResult:
    """``backtrack`` over ``mod`` split into pieces of at most ``max_ops`` bindings (module
    doc). A piece with no site inside is not searched; the others share three quarters of
    ``budget_s`` and of ``max_graphs`` by their number of sites (time a piece leaves unused
    goes to the next ones), the search across pieces the rest. A piece keeps a rewrite only
    when it gains ``min_gain`` of the piece's share (by size) of the graph's cost; the whole
    result is kept only when it gains ``min_gain`` of the graph's cost."""
    from .split import pieces_of

    t0 = time.perf_counter()
    pieces = pieces_of(mod, rewrites, max_ops)
    if len(pieces) <= 1:
        return backtrack(mod, cost, rewrites, alpha, budget_s, max_graphs, min_gain)
    start = cost(mod)
    owner = {v: k for k, piece in enumerate(pieces) for v in piece}
    total = sum(len(p) for p in pieces)
    out = RewriteResult(mod, start, start, graphs=1, pieces=[len(p) for p in pieces])
    cur, cur_cost = mod, start

    def owners(rw, g, site) -> set | None:
        vars_ = rw.site_vars(g, site)
        return None if vars_ is None else {owner.get(v) for v in vars_}

    def inside(k):
        # every var of the site is piece k's (or new, made while searching it)
        return lambda rw, g, site: (o := owners(rw, g, site)) is not None and o <= {k, None}

    def run(allowed, seconds: float, graphs: int, floor_ms: float) -> list:
        nonlocal cur, cur_cost
        res = backtrack(cur, cost, rewrites, alpha, max(0.0, seconds), max(1, graphs),
                     allowed=allowed, start_cost=cur_cost, min_gain_ms=floor_ms)
        out.graphs += res.graphs - 1
        out.pruned += res.pruned
        out.closed += res.closed
        if res.stopped != "queue empty":
            out.stopped = res.stopped
        if res.module is cur:
            return []
        known = {b.var for b in (_single_block(cur) or [])}
        new = [b.var for b in (_single_block(res.module) or []) if b.var not in known]
        cur, cur_cost = res.module, res.cost
        out.applied += res.applied
        return new

    sites = [0] * len(pieces)  # sites inside each piece, each rewrite's sites listed once
    for rw in rewrites:
        for site in rw.sites(mod):
            o = owners(rw, mod, site)
            if o is not None and len(o - {None}) == 1:
                sites[next(iter(o - {None}))] += 1
    graphs_left = 0.75 * max_graphs
    for k, piece in enumerate(pieces):
        if not sites[k]:
            continue
        weight = sites[k] / sum(sites[k:])
        seconds = (0.75 * budget_s - (time.perf_counter() - t0)) * weight
        before = out.graphs
        new = run(inside(k), seconds, int(graphs_left * weight),
                  min_gain * start * len(piece) / total)
        graphs_left -= out.graphs - before
        owner.update({v: k for v in new})
    # the stitch: sites across pieces (and whole-graph ones), from the joined result
    run(lambda rw, g, site: (o := owners(rw, g, site)) is None or len(o - {None}) > 1,
        budget_s - (time.perf_counter() - t0), max_graphs - out.graphs, 0.0)
    if cur_cost > start * (1.0 - min_gain):
        cur, cur_cost, out.applied = mod, start, []
    out.module, out.cost = cur, cur_cost
    out.seconds = time.perf_counter() - t0
    return out
