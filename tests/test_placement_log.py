"""Tests for the placement log (collage_tvm.placement_log)."""
import json
import logging
import multiprocessing


from collage_tvm.placement_log import PlacementLog


def test_roundtrip(tmp_path):
    path = tmp_path / "sub" / "placements.json"
    log = PlacementLog(path)
    assert log.get("m1") is None and log.keys() == []
    rec = {"groups": [{"backend": "dnnl", "nodes": [0, 1]}], "cost": 1.5}
    log.put("m1", rec)
    got = log.get("m1")
    assert got["groups"] == rec["groups"] and got["cost"] == 1.5
    assert isinstance(got["saved_at"], float)
    got["cost"] = 99  # callers get copies
    assert log.get("m1")["cost"] == 1.5
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and set(doc["placements"]) == {"m1"}
    # Another instance (another process, later) sees it, and sees new puts.
    other = PlacementLog(path)
    assert other.get("m1")["cost"] == 1.5
    log.put("m2", {"cost": 2.0})
    assert other.keys() == ["m1", "m2"]
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_in_memory():
    log = PlacementLog(None)
    log.put("k", {"cost": 1})
    assert log.get("k")["cost"] == 1 and log.keys() == ["k"]


def _putter(path, tag, n):
    log = PlacementLog(path)
    for i in range(n):
        log.put(f"{tag}-{i}", {"cost": float(i), "writer": tag})


def test_two_processes_putting_different_keys_lose_nothing(tmp_path):
    path = str(tmp_path / "placements.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_putter, args=(path, tag, 100)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    log = PlacementLog(path)
    assert len(log.keys()) == 200
    assert log.get("a-99")["writer"] == "a" and log.get("b-0")["writer"] == "b"
    assert log.recovered_from is None


def test_damaged_json_is_reported_and_moved_aside(tmp_path, caplog):
    path = tmp_path / "placements.json"
    path.write_text('{"version": 1, "placements": {"k": ')
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        log = PlacementLog(path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(path) in m and "invalid JSON" in m for m in warnings)
    aside = list(tmp_path.glob("placements.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"version": 1, "placements": {"k": '
    assert log.recovered_from == str(aside[0])
    assert log.keys() == []
    log.put("k", {"cost": 1.0})
    assert PlacementLog(path).get("k")["cost"] == 1.0


def test_wrong_structure_is_treated_as_damaged(tmp_path, caplog):
    path = tmp_path / "placements.json"
    path.write_text(json.dumps({"version": 2, "placements": {}}))
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        log = PlacementLog(path)
    assert log.recovered_from and "unsupported version" in caplog.text
    assert log.keys() == []
