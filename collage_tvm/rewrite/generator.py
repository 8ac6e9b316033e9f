"""The substitution generator (TASO, SOSP'19, section 2.3).

1. **Enumerate** every graph of up to ``max_ops`` operators over a core operator set
   (elementwise add and multiply, matmul, transpose, relu) and ``inputs`` square input
   tensors; each graph's value is its last operator's output (the inputs alone are graphs
   too, of no operator).
2. **Fingerprint** each graph by evaluating it on random integer inputs (arithmetic modulo a
   prime, so no rounding can make two different graphs agree), twice, with different inputs.
3. **Group** graphs with equal fingerprints; each pair within a group is a candidate
   substitution.
4. **Prune**: pairs equal up to renaming the inputs (one kept per orbit), and pairs that are a
   smaller candidate applied under the same operator (congruence: ``f(a, c) -> f(b, c)`` when
   ``a -> b`` is already a candidate).
5. **Verify** the survivors with z3 from the operator axioms (``verify.py``); what is not
   proved within the time limit is reported, not shipped.

``generate()`` returns the proved substitutions and the count at each stage.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

_PRIME = 2_147_483_647  # 2^31 - 1: products of two residues fit in int64... after a modulo
_UNARY = ("transpose", "relu")
_BINARY = ("add", "mul", "matmul")
_COMMUTATIVE = ("add", "mul")


@dataclass(frozen=True)
class Expr:
    """A graph: ``op`` over ``args`` (Exprs), or an input named ``op`` when ``args`` is ()."""
    op: str
    args: tuple = ()

    def __str__(self):
        return self.op if not self.args else f"{self.op}({', '.join(map(str, self.args))})"

    def size(self) -> int:
        return 0 if not self.args else 1 + sum(a.size() for a in self.args)

    def inputs(self) -> set:
        return {self.op} if not self.args else set().union(*(a.inputs() for a in self.args))


def enumerate_graphs(max_ops: int = 2, inputs: int = 2) -> list:
    """Every expression of at most ``max_ops`` operators over the inputs (commutative
    operators with their arguments in one canonical order)."""
    by_size: dict = {0: [Expr(f"x{i}") for i in range(inputs)]}
    for n in range(1, max_ops + 1):
        out = []
        for op in _UNARY:
            out += [Expr(op, (a,)) for a in by_size[n - 1]]
        for op in _BINARY:
            for left in range(n):
                for a in by_size[left]:
                    for b in by_size[n - 1 - left]:
                        if op in _COMMUTATIVE and str(a) > str(b):
                            continue
                        out.append(Expr(op, (a, b)))
        by_size[n] = out
    return [e for n in range(1, max_ops + 1) for e in by_size[n]]


def evaluate(expr: Expr, env: dict, prime: int | None = _PRIME) -> np.ndarray:
    """``expr`` on integer matrices modulo ``prime`` (relu keeps the residues below p/2), or
    on real matrices when ``prime`` is None (the numeric check of what was generated)."""
    if not expr.args:
        return env[expr.op]
    vals = [evaluate(a, env, prime) for a in expr.args]
    mod = (lambda v: v % prime) if prime else (lambda v: v)
    if expr.op == "add":
        return mod(vals[0] + vals[1])
    if expr.op == "mul":
        return mod(vals[0] * vals[1])
    if expr.op == "matmul":
        a, b = vals
        if not prime:
            return a @ b
        out = np.zeros((a.shape[0], b.shape[1]), np.int64)
        for k in range(a.shape[1]):  # one outer product at a time: every term below 2^62
            out = (out + np.outer(a[:, k], b[k, :]) % prime) % prime
        return out
    if expr.op == "transpose":
        return vals[0].T.copy()
    if expr.op == "relu":
        return np.where(vals[0] < (prime // 2 if prime else 0), vals[0], 0) if prime else \
            np.maximum(vals[0], 0)
    raise ValueError(f"unknown operator {expr.op!r}")


def fingerprint(expr: Expr, envs: list) -> bytes:
    return b"".join(evaluate(expr, env).tobytes() for env in envs)


def _renamings(expr: Expr, inputs: int):
    names = [f"x{i}" for i in range(inputs)]
    for perm in itertools.permutations(names):
        yield dict(zip(names, perm))


def _rename(expr: Expr, mapping: dict) -> Expr:
    if not expr.args:
        return Expr(mapping.get(expr.op, expr.op))
    args = tuple(_rename(a, mapping) for a in expr.args)
    if expr.op in _COMMUTATIVE and str(args[0]) > str(args[1]):
        args = (args[1], args[0])
    return Expr(expr.op, args)


def to_z3(expr: Expr, inputs: dict):
    from . import verify as V

    if not expr.args:
        return inputs[expr.op]
    fn = {"add": V.add, "mul": V.mul, "matmul": V.matmul, "transpose": V.transpose,
          "relu": V.relu}[expr.op]
    return fn(*[to_z3(a, inputs) for a in expr.args])


@dataclass
class Generated:
    substitutions: list                      # (source Expr, target Expr), proved
    unproved: list                           # (source, target) that z3 did not prove
    counts: dict = field(default_factory=dict)


def generate(max_ops: int = 2, inputs: int = 2, size: int = 3, seed: int = 0,
             timeout_ms: int = 2000, time_limit_s: float = 120.0) -> Generated:
    """Run the five stages (module doc); ``size`` is the side of the square inputs."""
    import z3

    from . import verify as V

    rng = np.random.default_rng(seed)
    envs = [{f"x{i}": rng.integers(0, _PRIME, (size, size), dtype=np.int64)
             for i in range(inputs)} for _ in range(2)]
    # the inputs themselves too: transpose(transpose(x0)) -> x0 removes two operators
    graphs = [Expr(f"x{i}") for i in range(inputs)] + enumerate_graphs(max_ops, inputs)
    groups: dict = {}
    for g in graphs:
        groups.setdefault(fingerprint(g, envs), []).append(g)
    pairs = [(a, b) for members in groups.values() if len(members) > 1
             for a, b in itertools.combinations(
                 sorted(members, key=lambda e: (e.size(), str(e))), 2)]
    counts = {"graphs": len(graphs), "fingerprint groups of 2+": sum(
        len(m) > 1 for m in groups.values()), "candidate pairs": len(pairs)}

    # prune: one pair per orbit of input renamings
    seen, kept = set(), []
    for a, b in pairs:
        orbit = {frozenset((str(_rename(a, m)), str(_rename(b, m))))
                 for m in _renamings(a, inputs)}
        if seen & orbit:
            continue
        seen |= orbit
        kept.append((a, b))
    counts["after input renaming"] = len(kept)
    # prune: congruence -- the same operator over a smaller pair and equal other arguments
    small = {frozenset((str(a), str(b))) for a, b in kept}
    kept = [(a, b) for a, b in kept if not _congruent(a, b, small)]
    counts["after common subgraphs"] = len(kept)

    xs = {f"x{i}": z3.Const(f"x{i}", V.T) for i in range(inputs)}
    proved, unproved, t0 = [], [], time.perf_counter()
    for a, b in kept:
        if time.perf_counter() - t0 > time_limit_s:
            unproved.append((a, b))
            continue
        proof = V.prove(f"{a} -> {b}", to_z3(a, xs), to_z3(b, xs), timeout_ms=timeout_ms)
        (proved if proof.proved else unproved).append((a, b))
    counts["proved by z3"] = len(proved)
    counts["not proved"] = len(unproved)
    return Generated(proved, unproved, counts)


def _congruent(a: Expr, b: Expr, pairs: set) -> bool:
    if a.op != b.op or not a.args or len(a.args) != len(b.args):
        return False
    differ = [(x, y) for x, y in zip(a.args, b.args) if x != y]
    if not differ:
        return True
    return len(differ) == 1 and frozenset((str(differ[0][0]), str(differ[0][1]))) in pairs
