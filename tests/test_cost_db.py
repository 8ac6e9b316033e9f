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
        assert st == {"path": ":memory:", "records": 601, "by_backend": {"dnnl": 1, "tvm": 600}, "failed": 1,
                      "failed_by_kind": {"cannot-run": 1}}
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


def test_failures_are_sorted_by_kind_and_only_those_of_the_moment_are_retried():
    from collage_tvm.measure.db import failure_kind

    assert failure_kind("timed out after 120 s") == "timeout"
    assert failure_kind("measurement process died (killed by signal SIGKILL)") == "crash"
    assert failure_kind("MemoryError: unable to allocate 3 GiB") == "memory"
    assert failure_kind("NotImplementedError: openvino cannot run op foo") == "cannot-run"
    died = CostRecord(math.inf, "measurement process died (exit code 1)", 0.0)
    assert died.failure_kind == "crash" and died.retry
    assert not CostRecord(math.inf, "measurement process died", 0.0, {"retried": True}).retry
    assert not CostRecord(math.inf, "TVMError: no schedule", 0.0).retry  # a real "cannot run"
    assert CostRecord(1.5, None, 0.0).failure_kind is None


def test_a_cost_cut_on_a_lazy_first_run_is_measured_again_once():
    # Before the second look (timing.SECOND_LOOK_MS), a 3 us kernel whose first call took
    # 0.3 ms was cut there and its cost recorded at 0.3 ms: a later run measures it again.
    from collage_tvm.measure.timing import SECOND_LOOK_MS

    lazy = "cut short: first run 0.300 ms > cutoff 0.060 ms"
    assert CostRecord(0.3, lazy, 0.0).retry
    far = f"cut short: first run {60.0 + SECOND_LOOK_MS + 1:.3f} ms > cutoff 60.000 ms"
    assert not CostRecord(111.0, far, 0.0).retry  # hopeless at once: a true cut
    assert not CostRecord(0.3, "cut short: first runs 0.300 and 0.200 ms > cutoff 0.060 ms",
                          0.0).retry  # warm too: a true cut
    db = CostDB(None)
    db.put("tvm", "1", "k", "dev", 0.3, lazy, {"label": "conv"})
    m = _cached_measurer(db)
    assert m._cached("tvm", "1", "k", "conv", lambda: (0.003, None, {"repeats": 500})) == 0.003
    assert m.retried == 1 and not db.get("tvm", "1", "k", "dev").retry
    assert m._cached("tvm", "1", "k", "conv", lambda: (9.0, None, {})) == 0.003  # kept now


def _cached_measurer(db):
    """A measurer's ``_cached`` (the DB lookup-or-measure) without a worker or target."""
    from collage_tvm.measure.measurer import Measurer

    m = Measurer.__new__(Measurer)
    m.db, m.device, m.deadline = db, "dev", None
    m.hits = m.measured = m.retried = 0
    m.failures = []
    return m


def test_a_candidate_that_crashed_its_measuring_process_is_measured_again_once():
    db = CostDB(None)
    m = _cached_measurer(db)
    crash = (math.inf, "measurement process died (killed by signal SIGKILL)", {})
    calls = []

    def measure(result):
        def run():
            calls.append(result)
            return result
        return run

    assert m._cached("ort", "1", "k", "conv", measure(crash)) == math.inf
    assert db.get("ort", "1", "k", "dev").retry  # a later run tries it again
    assert m._cached("ort", "1", "k", "conv", measure(crash)) == math.inf  # retried: failed
    assert m.retried == 1 and len(calls) == 2
    rec = db.get("ort", "1", "k", "dev")
    assert rec.extra["retried"] and not rec.retry
    assert m._cached("ort", "1", "k", "conv", measure((1.0, None, {}))) == math.inf  # stays
    assert len(calls) == 2 and m.hits == 1
    # A crash retried that then runs: the measurement replaces the failure.
    assert m._cached("ort", "1", "k2", "relu", measure(crash)) == math.inf
    assert m._cached("ort", "1", "k2", "relu", measure((0.25, None, {}))) == 0.25
    assert db.get("ort", "1", "k2", "dev").cost_ms == 0.25
    # A real "cannot run" is never measured again.
    assert m._cached("ort", "1", "k3", "gelu", measure((math.inf, "NotImplementedError: no",
                                                         {}))) == math.inf
    assert m._cached("ort", "1", "k3", "gelu", measure((0.1, None, {}))) == math.inf


def test_forget_deletes_by_backend_kind_and_label_and_refuses_no_filter(tmp_path):
    db = CostDB(tmp_path / "c.db")
    db.put("ort", "1", "a", "dev", 1.0, extra={"label": "conv2d+relu"})
    db.put("ort", "1", "b", "dev", math.inf, "timed out after 120 s", {"label": "matmul"})
    db.put("ort", "1", "c", "dev", math.inf, "NotImplementedError: no", {"label": "gelu"})
    db.put("dnnl", "3", "a", "dev", 2.0, extra={"label": "conv2d"})
    db.put("dnnl", "3", "d", "dev", math.inf, "measurement process died", {"label": "dense"})
    assert db.stats()["failed_by_kind"] == {"timeout": 1, "cannot-run": 1, "crash": 1}
    with pytest.raises(ValueError, match="name a backend"):
        db.forget()
    with pytest.raises(ValueError, match="'oops' is not one of"):
        db.forget(kind="oops")
    assert db.forget(kind="timeout") == 1 and db.get("ort", "1", "b", "dev") is None
    assert db.forget(backend="dnnl", kind="failed") == 1
    assert db.get("dnnl", "3", "a", "dev") is not None
    assert db.forget(label="conv2d") == 2  # both conv records, whatever the backend
    assert [r["key"] for r in db.rows()] == ["c"]


def test_a_write_locked_out_past_the_busy_timeout_waits_and_writes_again(tmp_path, monkeypatch):
    from collage_tvm.measure import db as dbmod

    db = CostDB(tmp_path / "c.db")
    monkeypatch.setattr(dbmod, "LOCKED_WAIT_S", 0.0)
    real, tries = db._use, []

    class Locked:
        def __init__(self, conn):
            self.conn = conn

        def execute(self, *args):
            tries.append(1)
            if len(tries) < 3:
                raise sqlite3.OperationalError("database is locked")
            return self.conn.execute(*args)

    from contextlib import contextmanager

    @contextmanager
    def flaky():
        with real() as conn:
            yield Locked(conn)

    monkeypatch.setattr(db, "_use", flaky)
    db.put("tvm", "1", "k", "cpu", 1.5)
    monkeypatch.setattr(db, "_use", real)
    assert len(tries) == 3 and db.get("tvm", "1", "k", "cpu").cost_ms == 1.5


def test_cli_db_forget_deletes_what_it_is_told_and_refuses_no_filter(tmp_path, capsys):
    from collage_tvm.cli import main

    path = str(tmp_path / "c.db")
    with CostDB(path) as db:
        db.put("ort", "1", "a", "dev", math.inf, "timed out after 120 s", {"label": "matmul"})
        db.put("ort", "1", "b", "dev", 1.0, extra={"label": "conv2d"})
    assert main(["db", "forget", "--db", path]) == 2
    assert "name a backend" in capsys.readouterr().err
    assert main(["db", "forget", "--db", path, "--kind", "timeout"]) == 0
    assert "forgot 1 records" in capsys.readouterr().out
    with CostDB(path) as db:
        assert [r["key"] for r in db.rows()] == ["b"]
