"""IOS's schedule: stages of concurrent groups, chosen by a dynamic program over ending sets.

IOS (Ding et al., "IOS: Inter-Operator Scheduler for CNN Acceleration", MLSys 2021,
Algorithm 1) runs a DAG of operators as a sequence of *stages*. A stage is either

- **concurrent**: its operators fall into *groups*, the weakly connected components of the
  stage's operators; each group runs its operators one after another (in topological order),
  the groups run at the same time, independent of each other (no edge between two groups);
- **merge**: two or more operators of the same kind on the same input, run as one wider
  operator (two convolutions of one tensor -> one convolution with both filter banks). Which
  operators can merge is the caller's ``merge`` key; ``stage_cost`` may still answer
  ``math.inf`` for a merge that cannot run.

The dynamic program: for a set S of operators closed under predecessors (a prefix of the graph,
what has run by the end of some stage),

    cost[S] = min over endings E of S:  cost[S - E] + stage_cost(stage of E),   cost[{}] = 0,

where an *ending* E of S is a non-empty subset with no edge from E to S - E (every successor
inside S of an operator of E is in E): what can run last. S - E is again a prefix, so the
states are the graph's prefixes (its ideals), computed smallest first; the choice of each
state is kept and the schedule is read back from the whole graph. ``schedule`` returns the
optimum over every sequence of valid stages, which the tests check against brute force.

Pruning (IOS's): a concurrent stage has at most ``max_groups`` (IOS's s, default 8) groups of
at most ``max_group_ops`` (r, default 3) operators each; ``None`` lifts a limit. Endings are
grown operator by operator in reverse topological order, each from its successors, so every
prefix of the growth is itself an ending and a group over r operators is cut as soon as it
forms. A merge stage takes sinks of S (operators with no successor in S) of one merge key.
Large graphs: ``max_part`` cuts the topological order into parts of that many operators,
scheduled one after another (IOS's ``max_part_size``): optimal within each part only.

Complexity, for a part of n operators and width d (the fewest chains that cover it):
the states are its prefixes, at most prod over a chain decomposition of (chain length + 1)
<= (n/d + 1)^d; an ending meets each chain in a suffix of at most r operators (one chain's
operators in an ending are connected, so in one group), so a state has at most (r + 1)^d
concurrent endings, each grown in O(n) steps, plus 2^(sinks of one key) merges. A chain is
n states of at most r + 1 endings; a wide graph needs the parts. A stage depends on its
operators alone, not on the state, so each distinct stage is costed once (memoised): that is
what a measured cost (a cost DB keyed by the stage and its thread split) pays for.

In Collage, a node is a placed group of the placement (a library region or a TVM kernel) and
an edge a tensor between two groups; a concurrent stage runs its groups at once, each on its
own share of the cores (the thread split, part of a stage's measured cost); the sequential
schedule (``sequential``), one group a stage in topological order, is how a placement runs
today and the baseline a schedule must beat.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Optional, Sequence

MAX_GROUPS = 8  # IOS's s: groups in a concurrent stage (IOS's code, max_num_groups)
MAX_GROUP_OPS = 3  # IOS's r: operators in one group (IOS's code, max_group_size)

CONCURRENT = "concurrent"
MERGE = "merge"


@dataclass(frozen=True)
class Stage:
    """One stage: ``groups`` run at the same time, each one's nodes in that order.

    A merge stage has one node a group: the nodes become one operator."""
    groups: tuple[tuple[int, ...], ...]
    kind: str = CONCURRENT

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(x for group in self.groups for x in group)

    @property
    def key(self) -> str:
        """A stable text for a cost DB: ``concurrent:0,1|2``, ``merge:3|4``."""
        return f"{self.kind}:" + "|".join(",".join(map(str, g)) for g in self.groups)


@dataclass
class Schedule:
    """Stages in the order they run; ``cost`` the sum of their costs (nan: none given).

    ``states``: the DP's states (graph prefixes); ``costed``: distinct stages costed."""
    stages: list[Stage]
    cost: float
    states: int = 0
    costed: int = 0


def topological_order(succ: Sequence[Iterable[int]]) -> list[int]:
    """The nodes 0..n-1 of ``succ`` (``succ[i]``: the successors of node i) in topological
    order, the smallest ready node first; ValueError for a bad node, a self-edge or a cycle."""
    n = len(succ)
    indegree = [0] * n
    for i, targets in enumerate(succ):
        for j in targets:
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < n:
                raise ValueError(f"node {i} has a successor {j!r} outside 0..{n - 1}")
            if j == i:
                raise ValueError(f"node {i} is its own successor: a cycle")
        for j in set(targets):
            indegree[j] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in set(succ[i]):
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < n:
        cyclic = sorted(i for i in range(n) if indegree[i] > 0)
        raise ValueError(f"the graph has a cycle through nodes among {cyclic}")
    return order


def sequential(succ: Sequence[Iterable[int]],
               stage_cost: Optional[Callable[[Stage], float]] = None) -> Schedule:
    """One node a stage, in topological order: how the graph runs without a schedule."""
    stages = [Stage(((x,),)) for x in topological_order(succ)]
    if stage_cost is None:
        return Schedule(stages, math.nan)
    costs = [_checked(stage_cost, st) for st in stages]
    return Schedule(stages, sum(costs), costed=len(stages))


def same_kind_siblings(kinds: Sequence[Optional[Hashable]],
                       succ: Sequence[Iterable[int]]) -> Callable[[int], Optional[Hashable]]:
    """A ``merge`` key: nodes of one kind (not None) that read the same single input (one
    same predecessor, or none: the graph's input) may merge. ``kinds[i]`` should hold what
    must agree for a merge (an operator's name, its stride and activation, ...)."""
    preds: list[set[int]] = [set() for _ in kinds]
    for i, targets in enumerate(succ):
        for j in targets:
            preds[j].add(i)

    def key(x: int) -> Optional[Hashable]:
        if kinds[x] is None or len(preds[x]) > 1:
            return None
        return (kinds[x], tuple(preds[x]))
    return key


def schedule(succ: Sequence[Iterable[int]], stage_cost: Callable[[Stage], float],
             max_groups: Optional[int] = MAX_GROUPS, max_group_ops: Optional[int] = MAX_GROUP_OPS,
             merge: Optional[Callable[[int], Optional[Hashable]]] = None,
             max_part: Optional[int] = None) -> Schedule:
    """The cheapest sequence of stages for the DAG ``succ`` (``succ[i]``: the successors of
    node i, nodes 0..n-1), by IOS's dynamic program over ending sets (module docstring).

    ``stage_cost(stage)``: the stage's latency, ``math.inf`` where it cannot run; called at
    most once a distinct stage (``Schedule.costed`` says how many).
    ``max_groups``/``max_group_ops``: IOS's pruning (None: no limit).
    ``merge(node)``: a key, nodes of one key (not None) that are sinks of a state together may
    merge into one stage (``same_kind_siblings`` builds one); None: no merge stages.
    ``max_part``: schedule the topological order in parts of that many nodes (None: the whole
    graph at once).
    ValueError: a cyclic graph, a bad limit, a bad cost, or no schedule of finite cost."""
    for name, value in (("max_groups", max_groups), ("max_group_ops", max_group_ops),
                        ("max_part", max_part)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    dag = _Dag(succ)
    memo: dict[Stage, float] = {}

    def cost_of(stage: Stage) -> float:
        if stage not in memo:
            memo[stage] = _checked(stage_cost, stage)
        return memo[stage]

    stages: list[Stage] = []
    total, states = 0.0, 0
    step = max_part or max(dag.n, 1)
    for begin in range(0, dag.n, step):
        part = sum(1 << x for x in dag.order[begin:begin + step])
        part_stages, part_cost, part_states = _dp(dag, part, cost_of, max_groups, max_group_ops,
                                                  merge)
        stages += part_stages
        total += part_cost
        states += part_states
    return Schedule(stages, total, states=states, costed=len(memo))


# ---------------------------------------------------------------------------------------------


class _Dag:
    """Bitmasks of a DAG: ``succ[x]``, ``pred[x]``; ``order`` topological, ``pos`` its inverse."""

    def __init__(self, succ: Sequence[Iterable[int]]):
        succ = [list(targets) for targets in succ]
        self.order = topological_order(succ)
        self.n = len(succ)
        self.pos = {x: k for k, x in enumerate(self.order)}
        self.succ = [sum(1 << j for j in set(targets)) for targets in succ]
        self.pred = [0] * self.n
        for i, targets in enumerate(succ):
            for j in set(targets):
                self.pred[j] |= 1 << i

    def nodes(self, mask: int) -> list[int]:
        """The nodes of ``mask`` in topological order."""
        return [x for x in self.order if mask >> x & 1]

    def stage(self, comps: Iterable[int], kind: str = CONCURRENT) -> Stage:
        groups = sorted((tuple(self.nodes(c)) for c in comps), key=lambda g: self.pos[g[0]])
        return Stage(tuple(groups), kind)


def _checked(stage_cost: Callable[[Stage], float], stage: Stage) -> float:
    value = float(stage_cost(stage))
    if math.isnan(value) or value < 0:
        raise ValueError(f"stage_cost({stage.key}) = {value}: a cost must be >= 0 or inf")
    return value


def _prefixes(dag: _Dag, part: int) -> list[list[int]]:
    """Every subset of ``part`` closed under predecessors within it, by size: the DP's states."""
    layers = [[0]]
    for _ in range(part.bit_count()):
        grown = set()
        for state in layers[-1]:
            for x in dag.nodes(part & ~state):
                if not dag.pred[x] & part & ~state:
                    grown.add(state | 1 << x)
        layers.append(sorted(grown))
    return layers


def _endings(dag: _Dag, state: int, max_groups: Optional[int], max_group_ops: Optional[int],
             merge: Optional[Callable[[int], Optional[Hashable]]]) -> list[tuple[int, Stage]]:
    """The valid last stages of ``state``: (its nodes, the stage), concurrent ones within the
    pruning limits, then merges."""
    found: list[tuple[int, Stage]] = []
    nodes = dag.nodes(state)[::-1]  # sinks first: a node joins once its successors are in
    cap = len(nodes)
    if max_groups is not None and max_group_ops is not None:
        cap = min(cap, max_groups * max_group_ops)

    def grow(start: int, ending: int, comps: list[int]) -> None:
        for k in range(start, len(nodes)):
            x = nodes[k]
            after = dag.succ[x] & state
            if after & ~ending:
                continue  # a successor of x runs after the stage: x cannot be in it
            joined, rest = 1 << x, []
            for comp in comps:
                if comp & after:
                    joined |= comp
                else:
                    rest.append(comp)
            if max_group_ops is not None and joined.bit_count() > max_group_ops:
                continue  # a group only grows as the ending does
            grown, comps2 = ending | 1 << x, rest + [joined]
            if max_groups is None or len(comps2) <= max_groups:
                found.append((grown, dag.stage(comps2)))
            if grown.bit_count() < cap:
                grow(k + 1, grown, comps2)  # later nodes may still join groups together

    grow(0, 0, [])
    if merge is not None:
        classes: dict[Hashable, list[int]] = {}
        for x in dag.nodes(state):
            if not dag.succ[x] & state:
                key = merge(x)
                if key is not None:
                    classes.setdefault(key, []).append(x)
        for members in classes.values():
            for size in range(2, len(members) + 1):
                for chosen in itertools.combinations(members, size):
                    found.append((sum(1 << x for x in chosen),
                                  dag.stage((1 << x for x in chosen), MERGE)))
    return found


def _dp(dag: _Dag, part: int, cost_of: Callable[[Stage], float], max_groups: Optional[int],
        max_group_ops: Optional[int], merge: Optional[Callable[[int], Optional[Hashable]]]
        ) -> tuple[list[Stage], float, int]:
    """IOS's Algorithm 1 on ``part`` (every node before it already ran): its stages, cost and
    the number of states."""
    best: dict[int, float] = {0: 0.0}
    choice: dict[int, tuple[int, Stage]] = {}
    layers = _prefixes(dag, part)
    for layer in layers[1:]:
        for state in layer:
            value, pick = math.inf, None
            for ending, stage in _endings(dag, state, max_groups, max_group_ops, merge):
                before = best[state & ~ending]
                if before == math.inf:
                    continue
                total = before + cost_of(stage)
                if total < value:
                    value, pick = total, (ending, stage)
            best[state] = value
            if pick is not None:
                choice[state] = pick
    if best[part] == math.inf:
        raise ValueError("no schedule of finite cost: stage_cost is inf for every stage sequence "
                         f"of the nodes {dag.nodes(part)}")
    stages, state = [], part
    while state:
        ending, stage = choice[state]
        stages.append(stage)
        state &= ~ending
    return stages[::-1], best[part], sum(len(layer) for layer in layers)
