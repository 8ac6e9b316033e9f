"""Tests for the cost database (collage_tvm.measure.db)."""
import json
import logging
import math
import multiprocessing
import os
import sqlite3
from pathlib import Path


import pytest

from collage_tvm.measure.db import CostDB, CostRecord


def test_roundtrip_put_get(tmp_path):
    with CostDB(tmp_path / "costs.db") as db:
        db.put("dnnl", "3.1", "k1", "cpu", 1.25, extra={"label": "dnnl.conv2d_bias_relu", "repeats": 30})
        db.put("cutlass", "2.11", "k2", "cuda:0", math.inf, reason="build failed: no kernel")
        r = db.get("dnnl", "3.1", "k1", "cpu")
        assert isinstance(r, CostRecord)
        assert r.cost_ms == 1.25 and r.reason is None
        assert r.extra == {"label": "dnnl.conv2d_bias_relu", "repeats": 30}
        assert r.measured_at > 0
        f = db.get("cutlass", "2.11", "k2", "cuda:0")
        assert math.isinf(f.cost_ms) and f.cost_ms > 0
        assert f.reason == "build failed: no kernel" and f.extra == {}
        assert len(db) == 2
    # persisted across reopen
    with CostDB(tmp_path / "costs.db") as db:
        assert db.get("dnnl", "3.1", "k1", "cpu").cost_ms == 1.25
        assert math.isinf(db.get("cutlass", "2.11", "k2", "cuda:0").cost_ms)
        assert db.recovered_from is None


def test_key_includes_version_and_device(tmp_path):
    db = CostDB(tmp_path / "costs.db")
    db.put("tvm", "0.19", "k", "cuda:0", 2.0)
    assert db.get("tvm", "0.20", "k", "cuda:0") is None
    assert db.get("tvm", "0.19", "k", "cpu") is None
    assert db.get("cublas", "0.19", "k", "cuda:0") is None
    assert db.get("tvm", "0.19", "k", "cuda:0").cost_ms == 2.0
    db.put("tvm", "0.20", "k", "cuda:0", 3.0)
    assert len(db) == 2
    db.put("tvm", "0.20", "k", "cuda:0", 4.0)  # overwrite, not a new row
    assert len(db) == 2 and db.get("tvm", "0.20", "k", "cuda:0").cost_ms == 4.0
    db.close()


def test_get_many_stats_rows_in_memory():
    for db in (CostDB(), CostDB(":memory:")):
        assert db.path == ":memory:"
        keys = [f"k{i}" for i in range(1200)]  # more than one SQL chunk
        for k in keys[::2]:
            db.put("tvm", "1", k, "cpu", 1.0)
        db.put("dnnl", "1", "x", "cpu", math.inf, reason="unsupported")
        got = db.get_many("tvm", "1", keys, "cpu")
        assert set(got) == set(keys[::2])
        assert db.get_many("tvm", "1", [], "cpu") == {}
        st = db.stats()
        assert st == {"path": ":memory:", "records": 601, "by_backend": {"dnnl": 1, "tvm": 600}, "failed": 1}
        rows = db.rows()
        assert len(rows) == 601
        assert set(rows[0]) == {"backend", "version", "key", "device", "cost_ms", "reason", "measured_at", "extra"}
        db.close()


def test_bad_values_rejected():
    db = CostDB()
    with pytest.raises(ValueError):
        db.put("tvm", "1", "k", "cpu", math.nan)
    with pytest.raises(TypeError):
        db.put("tvm", "1", "k", "cpu", 1.0, extra={"f": object()})
    assert len(db) == 0


def test_parent_directories_created(tmp_path):
    path = tmp_path / "a" / "b" / "costs.db"
    with CostDB(path) as db:
        db.put("tvm", "1", "k", "cpu", 1.0)
    assert path.exists()


def _writer(path, tag, n):
    db = CostDB(path)
    for i in range(n):
        db.put("tvm", "1", f"{tag}-{i}", "cpu", float(i), extra={"writer": tag})
    db.close()


def test_two_processes_writing_the_same_db_lose_nothing(tmp_path):
    path = str(tmp_path / "shared.db")
    CostDB(path).close()  # create it up front; the writers race on writes, not on creation
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, tag, 300)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with CostDB(path) as db:
        assert len(db) == 600
        assert db.stats()["by_backend"] == {"tvm": 600}
        assert db.get("tvm", "1", "b-299", "cpu").extra == {"writer": "b"}
        assert db.recovered_from is None


def test_corrupted_db_is_reported_and_rebuilt(tmp_path, caplog):
    path = tmp_path / "costs.db"
    garbage = os.urandom(4096)
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        db = CostDB(path)
    assert any(str(path) in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    aside = list(tmp_path.glob("costs.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert db.recovered_from == str(aside[0])
    db.put("tvm", "1", "k", "cpu", 1.0)
    assert db.get("tvm", "1", "k", "cpu").cost_ms == 1.0
    db.close()
    with CostDB(path) as again:  # the rebuilt file is healthy
        assert again.recovered_from is None and len(again) == 1


def test_truncated_db_is_reported_and_rebuilt(tmp_path, caplog):
    path = tmp_path / "costs.db"
    with CostDB(path) as db:
        for i in range(2000):
            db.put("tvm", "1", f"key-{i:05d}-" + "x" * 40, "cpu", float(i), extra={"i": i})
    size = path.stat().st_size
    assert size > 8 * 4096
    assert not Path(str(path) + "-wal").exists()  # checkpointed on close
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        db = CostDB(path)
    assert db.recovered_from is not None
    assert any(str(path) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert Path(db.recovered_from).stat().st_size == size // 2
    assert len(db) == 0
    db.put("tvm", "1", "k", "cpu", 1.0)
    assert len(db) == 1
    db.close()


def test_foreign_or_newer_schema_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "costs.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE costs (x)")
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        db = CostDB(path)
    assert db.recovered_from and "unknown schema version 99" in caplog.text
    db.put("tvm", "1", "k", "cpu", 1.0)
    assert len(db) == 1
    db.close()


def test_empty_file_is_initialised_without_warning(tmp_path, caplog):
    path = tmp_path / "costs.db"
    path.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        with CostDB(path) as db:
            db.put("tvm", "1", "k", "cpu", 1.0)
            assert db.recovered_from is None
    assert not caplog.records


def test_export_import_json_roundtrip(tmp_path):
    src = CostDB()
    src.put("dnnl", "3.1", "k1", "cpu", 0.5, extra={"label": "dnnl.dense"})
    src.put("cutlass", "2.11", "k2", "cuda:0", math.inf, reason="timeout")
    out = tmp_path / "export" / "costs.json"
    assert src.export_json(out) == 2
    doc = json.loads(out.read_text())  # strict JSON: inf is a string
    assert sorted(r["cost_ms"] for r in doc["records"] if isinstance(r["cost_ms"], str)) == ["inf"]
    assert "Infinity" not in out.read_text()

    dst = CostDB(tmp_path / "dst.db")
    assert dst.import_json(out) == 2
    assert dst.rows() == src.rows()
    failed = dst.get("cutlass", "2.11", "k2", "cuda:0")
    assert math.isinf(failed.cost_ms) and failed.reason == "timeout"
    # Re-importing the same (not newer) records changes nothing.
    assert dst.import_json(out) == 0
    dst.close()


def test_import_newer_measured_at_wins(tmp_path):
    db = CostDB()
    db.put("tvm", "1", "old", "cpu", 1.0)
    db.put("tvm", "1", "new", "cpu", 1.0)
    now = db.get("tvm", "1", "old", "cpu").measured_at
    doc = {"version": 1, "records": [
        {"backend": "tvm", "version": "1", "key": "old", "device": "cpu", "cost_ms": 9.0,
         "reason": None, "measured_at": now - 100, "extra": {}},
        {"backend": "tvm", "version": "1", "key": "new", "device": "cpu", "cost_ms": "inf",
         "reason": "oom", "measured_at": now + 100, "extra": {"src": "other"}},
    ]}
    p = tmp_path / "in.json"
    p.write_text(json.dumps(doc))
    assert db.import_json(p) == 1
    assert db.get("tvm", "1", "old", "cpu").cost_ms == 1.0
    new = db.get("tvm", "1", "new", "cpu")
    assert math.isinf(new.cost_ms) and new.reason == "oom" and new.extra == {"src": "other"}


@pytest.mark.parametrize("content, what", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"version": 1, "records": [{"backend": "tvm"}]}', "missing field"),
    ('{"version": 1, "records": [{"backend": "tvm", "version": "1", "key": "k", "device": "cpu",'
     ' "cost_ms": "fast", "measured_at": 1}]}', "cost_ms"),
    ('{"version": 7, "records": []}', "version"),
])
def test_import_bad_json_raises_value_error_naming_file(tmp_path, content, what):
    p = tmp_path / "bad-costs.json"
    p.write_text(content)
    db = CostDB()
    with pytest.raises(ValueError) as info:
        db.import_json(p)
    assert str(p) in str(info.value) and what in str(info.value)
    assert len(db) == 0
