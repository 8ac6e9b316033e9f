"""Where a search keeps what it learned: the cost DB, the placement log (keyed by
``placement_key``) and the tuning records TVM's kernels use."""
from __future__ import annotations

import hashlib
import logging
import os

from tvm import relax

from .graph.subgraph import function_key
from .measure.db import CostDB
from .measure.keys import COST_MODEL
from .options import SearchOptions
from .placement_log import PlacementLog
from .tuning import TuningDB, default_dir, open_tuning_db

logger = logging.getLogger("collage_tvm")

DEFAULT_DB = os.path.join(os.path.expanduser("~"), ".cache", "collage-tvm", "costs.db")


def placement_key(main: relax.Function, target, backends: dict,
                  options: SearchOptions | None = None, tuning: str = "") -> str:
    """The placement-log key: the model, the target, each backend's library version, the
    cost model's revision (``measure.keys.COST_MODEL``), every option that changes the
    search (``SearchOptions.key_variant``) and the tuning records TVM's kernels use
    (``TuningDB.digest``; "" when untuned)."""
    parts = [function_key(main), str(target)] + sorted(f"{n}={b.version()}" for n, b in backends.items())
    parts.append(f"costs={COST_MODEL}")
    if tuning:
        parts.append(f"tuning={tuning}")
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
    variant = (options or SearchOptions()).key_variant()
    return hashlib.sha256(f"{key}{variant}".encode()).hexdigest()[:32] if variant else key


def open_db(db) -> CostDB:
    """A ``CostDB`` from a path (None: ``DEFAULT_DB``) or the DB itself; a damaged file is
    reported, moved aside and rebuilt."""
    if isinstance(db, CostDB):
        return db
    path = DEFAULT_DB if db is None else db
    cost_db = CostDB(path)
    if cost_db.recovered_from:
        logger.warning("cost DB %s was damaged; moved aside to %s and rebuilt",
                       path, cost_db.recovered_from)
    return cost_db


def open_placement_log(log, db: CostDB) -> PlacementLog:
    """A ``PlacementLog`` from a path or the log itself; None: next to the cost DB file
    (``<db>.placements.json``), in memory for an in-memory DB."""
    if isinstance(log, PlacementLog):
        return log
    if log is None:
        path = getattr(db, "path", None)
        log = None if path in (None, ":memory:") else f"{os.fspath(path)}.placements.json"
    return PlacementLog(log)


def open_tuning(options: SearchOptions, cost_db: CostDB, target, tuning_db=None):
    """The tuning database a build applies: ``tuning_db`` (a path or a ``TuningDB``), else
    the one next to the cost DB for this target (``collage-tvm tune`` fills it); None when
    ``options.tuning`` is off or the database holds no record."""
    if not options.tuning:
        return None
    if tuning_db is None:
        tuning_db = default_dir(getattr(cost_db, "path", None), target)
    db = tuning_db if isinstance(tuning_db, TuningDB) else open_tuning_db(tuning_db, target)
    return db if db is not None and len(db) else None
