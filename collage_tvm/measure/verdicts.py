"""A lean search's verdict kept in the cost DB (``placer.lean``): which candidates it left
unmeasured, so that a later search over the same candidates takes it rather than asking the
DP again (``Measurer.skipped_before``, ``Measurer.keep_skipped``)."""
from __future__ import annotations

import hashlib
import math

from .keys import LEAN_KEY


def skipped_before(measurer, graph, candidates, backends: dict, tag: str = "") -> set | None:
    """The identities (``Measurer.identities``) a lean search over these same candidates,
    with the parameters ``tag``, left unmeasured, as the cost DB keeps them
    (``keep_skipped``); None when it keeps no such verdict."""
    rec = measurer.db.get(*_lean_key(measurer, graph, candidates, backends, tag),
                          measurer.device)
    if rec is None or not isinstance(rec.extra.get("skipped"), list):
        return None
    return {tuple(x) for x in rec.extra["skipped"]}


def keep_skipped(measurer, graph, candidates, backends: dict, skipped: set, lower_ms: float,
                 tag: str = "") -> None:
    """Keep a lean search's verdict in the cost DB: the identities it left unmeasured
    (``skipped``) and the DP's answer on its lower bounds (``lower_ms``). The next search
    over the same candidates and DB takes it rather than asking the DP again on lower
    bounds that the costs measured since (carved regions, a later stage's) may have
    lowered."""
    name, version, key = _lean_key(measurer, graph, candidates, backends, tag)
    measurer.db.put(name, version, key, measurer.device,
                    lower_ms if math.isfinite(lower_ms) else 0.0, None,
                    {"label": "lean search", "skipped": sorted(list(x) for x in skipped)})


def _lean_key(measurer, graph, candidates, backends: dict, tag: str) -> tuple:
    """(backend, version, key) of the lean verdict over ``candidates``."""
    idents = sorted(set(measurer.identities(graph, candidates, backends).values()))
    names = sorted({name for name, _ in idents})
    digest = hashlib.sha1("|".join([tag, *(f"{n}:{k}" for n, k in idents)]).encode())
    return ("+".join(names), "+".join(backends[n].version() for n in names),
            f"{LEAN_KEY}:{digest.hexdigest()}")
