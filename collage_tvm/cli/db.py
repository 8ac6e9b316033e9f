"""``collage-tvm db``: the cost DB (and the tuning databases beside it)
inspected, exported, imported or forgotten."""
from __future__ import annotations

import json
import math
import sys


def _tuning_stats(db_path) -> list:
    """Every tuning database next to the cost DB (one per target): workloads, records."""
    import os

    import tvm

    from ..tuning import TuningDB, tuning_root

    base = tuning_root(db_path)
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
            db = TuningDB(path, tvm.target.Target(json.loads(meta["target"])))
            out.append({**db.stats(), "device": meta.get("device", "")})
        except (OSError, ValueError, KeyError) as err:
            out.append({"path": path, "error": str(err)})
    return out


def _db(args) -> int:
    from ..measure.db import CostDB

    db = CostDB(args.db)
    if args.action == "stats":
        stats = db.stats()
        stats["tuning"] = _tuning_stats(args.db)
        print(json.dumps(stats, indent=1))
    elif args.action == "export":
        print(f"exported {db.export_json(args.file)} records to {args.file}")
    elif args.action == "import":
        print(f"imported {db.import_json(args.file)} records from {args.file}")
    elif args.action == "forget":
        try:
            n = db.forget(args.backend, args.kind, args.label)
        except ValueError as err:
            print(f"collage-tvm: error: db {err}", file=sys.stderr)
            return 2
        print(f"forgot {n} records of {db.path}: the next search measures them again")
    elif args.action == "show":
        for r in sorted(db.rows(), key=lambda r: (r["backend"], r["cost_ms"]))[: args.limit]:
            cost = "inf" if math.isinf(r["cost_ms"]) else f"{r['cost_ms']:.4f}"
            print(f"{r['backend']:<8} {cost:>10} ms  {r['extra'].get('label', '')}  "
                  f"{r['reason'] or ''}")
    return 0
