"""`collage-tvm show`: the placement picture (SVG, HTML, PNG) of a hand-made placement of a
small model, the layout's invariants and the errors for records it cannot draw."""
import json
import random
import struct
import sys
import xml.etree.ElementTree as ET

import pytest

from collage_tvm.tools import show
from collage_tvm.check import byoc_groups
from collage_tvm.placement import placement_record
from collage_tvm.placement import Candidate, Placement
from collage_tvm.cli import main
from collage_tvm.frontend import load_model, normalize_for_collage
from collage_tvm.graph import DataflowGraph
from collage_tvm.tools.zoo import export_onnx
from collage_tvm.registry import get_backend

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """resnet_small placed by hand: dnnl's greedy groups, TVM singletons, one node on an
    unregistered backend (fallback colour); the shipped build's latency recorded."""
    path = export_onnx("resnet_small", str(tmp_path_factory.mktemp("m") / "resnet_small.onnx"))
    graph = DataflowGraph(normalize_for_collage(load_model(path))["main"])
    groups = byoc_groups(graph, get_backend("dnnl"))
    k = max(k for k, g in enumerate(groups) if g.backend == "tvm")
    groups[k] = Candidate("mylib", groups[k].nodes, "mylib.op")
    rec = placement_record(Placement(groups, 1.0), graph, "llvm",
                           {"collage": {"ms": 1.2345, "match": True, "max_err": 0.0}})
    assert {g["backend"] for g in rec["groups"]} == {"dnnl", "tvm", "mylib"}
    assert any(len(g["nodes"]) > 1 for g in rec["groups"])
    return json.loads(json.dumps(rec))  # as `show` reads it back from the file


def _by_class(root, cls):
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]


def _rect(g):
    return g.find(f"{SVG}rect")


def test_svg_has_every_node_group_edge_and_backend(record, tmp_path):
    out = show.render(record, str(tmp_path / "p.svg"))
    root = ET.parse(out).getroot()
    nodes, groups = record["graph"]["nodes"], record["groups"]
    colours = show.backend_colours(g["backend"] for g in groups)
    assert colours["dnnl"] == show.BACKEND_COLOURS["dnnl"]
    assert colours["tvm"] == show.BACKEND_COLOURS["tvm"]
    assert colours["mylib"] in show.FALLBACK_COLOURS

    drawn = {int(g.get("data-node")): g for g in _by_class(root, "node")}
    assert sorted(drawn) == list(range(len(nodes)))
    owner = {i: g for g in groups for i in g["nodes"]}
    for i, g in drawn.items():
        assert _rect(g).get("fill") == colours[owner[i]["backend"]]
        assert g.find(f"{SVG}text").text == show.short_op(nodes[i]["op"])
    assert drawn[0].find(f"{SVG}text").text == "conv2d"

    boxes = _by_class(root, "group")
    fused = [g for g in groups if len(g["nodes"]) > 1]
    assert len(boxes) == len(fused)
    assert all(_rect(b).get("stroke-dasharray") for b in boxes)
    # Each dashed box encloses its group's nodes.
    for b in boxes:
        r = _rect(b)
        x0, y0 = float(r.get("x")), float(r.get("y"))
        x1, y1 = x0 + float(r.get("width")), y0 + float(r.get("height"))
        for i in groups[int(b.get("data-group"))]["nodes"]:
            n = _rect(drawn[i])
            assert x0 <= float(n.get("x")) and float(n.get("x")) + float(n.get("width")) <= x1
            assert y0 <= float(n.get("y")) and float(n.get("y")) + float(n.get("height")) <= y1

    # One edge per producer -> consumer pair; every producer drawn above its consumers.
    edges = {(int(e.get("data-from")), int(e.get("data-to"))) for e in _by_class(root, "edge")}
    assert edges == {(p, c) for c, n in enumerate(nodes) for p in n["inputs"]}
    for p, c in edges:
        assert float(_rect(drawn[p]).get("y")) < float(_rect(drawn[c]).get("y"))

    legend = {g.get("data-backend"): _rect(g).get("fill") for g in _by_class(root, "legend")}
    assert legend == colours
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "shipped build: collage (1.234 ms)" in texts
    n_dnnl = sum(1 for g in groups if g["backend"] == "dnnl")
    assert f"dnnl: {n_dnnl} kernels" in texts


def test_html_embeds_the_svg_with_tooltips(record, tmp_path):
    page = open(show.render(record, str(tmp_path / "p.html")), encoding="utf-8").read()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    svg = page[page.index("<svg"):page.index("</svg>") + len("</svg>")]
    root = ET.fromstring(svg)
    nodes = _by_class(root, "node")
    assert len(nodes) == len(record["graph"]["nodes"])
    assert len(_by_class(root, "legend")) == 3
    tips = {int(g.get("data-node")): g.find(f"{SVG}title").text for g in nodes}
    group0 = next(g for g in record["groups"] if 0 in g["nodes"])
    tip = tips[0]
    assert "node 0 (relax.nn.conv2d)" in tip
    assert "shape: " + "x".join(map(str, record["graph"]["nodes"][0]["shape"])) in tip
    assert group0["label"] in tip and "op-level" in tip and group0["backend"] in tip
    assert "graph output" in tips[record["graph"]["outputs"][0]]


def test_png_has_the_svg_layout_size(record, tmp_path):
    data = open(show.render(record, str(tmp_path / "p.png")), "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    sc = show.scene(record)
    assert (width, height) == (sc.width, sc.height)
    assert height > 20 * show.ROW  # resnet_small's longest path is over 20 operators
    assert len(data) > 20_000      # drawn, not blank


def test_cli_writes_svg_by_default_and_the_format_of_the_extension(record, tmp_path, capsys):
    src = tmp_path / "placement.json"
    src.write_text(json.dumps(record))
    assert main(["show", str(src)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "placement.svg")
    assert (tmp_path / "placement.svg").read_text().startswith("<svg")
    for ext in ("png", "html"):
        out = tmp_path / f"pic.{ext}"
        assert main(["show", str(src), "-o", str(out)]) == 0
        assert out.stat().st_size > 0


def test_without_matplotlib_png_is_a_clear_error_and_svg_html_still_work(record, tmp_path,
                                                                         capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.raises(ImportError, match=r"pip install 'collage-tvm\[plot\]'"):
        show.render(record, str(tmp_path / "p.png"))
    src = tmp_path / "placement.json"
    src.write_text(json.dumps(record))
    assert main(["show", str(src), "-o", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("collage-tvm: error: ") and "collage-tvm[plot]" in err, err
    assert not (tmp_path / "p.png").exists()
    for ext in ("svg", "html"):
        assert main(["show", str(src), "-o", str(tmp_path / f"p.{ext}")]) == 0
        assert (tmp_path / f"p.{ext}").stat().st_size > 0


@pytest.mark.parametrize("case", ["old", "uncovered", "twice", "not-json", "missing", "format"])
def test_cli_errors_name_the_problem(record, tmp_path, capsys, case):
    src = tmp_path / "placement.json"
    rec = json.loads(json.dumps(record))
    out = str(tmp_path / "p.svg")
    expected = {"old": [str(src), "no \"graph\"", "Re-run `collage-tvm optimize MODEL -o"],
                "uncovered": [str(src), "do not cover 1 of", "node 3"],
                "twice": [str(src), "node 3 is in two groups"],
                "not-json": [str(src), "is not JSON"],
                "missing": [str(tmp_path / "nope.json"), "no such file"],
                "format": ["p.pdf", "use .svg, .html or .png"]}[case]
    if case == "old":  # written before placement records carried the graph
        del rec["graph"]
    elif case in ("uncovered", "twice"):
        g = next(g for g in rec["groups"] if 3 in g["nodes"])
        if case == "uncovered":
            g["nodes"].remove(3)
        else:
            next(h for h in rec["groups"] if 3 not in h["nodes"])["nodes"].append(3)
    elif case == "missing":
        src = tmp_path / "nope.json"
    elif case == "format":
        out = str(tmp_path / "p.pdf")
    if case != "missing":
        src.write_text("{ not json" if case == "not-json" else json.dumps(rec))
    assert main(["show", str(src), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("collage-tvm: error: ")
    for part in expected:
        assert part in err, err
    assert not (tmp_path / "p.svg").exists()


def test_backend_colours_fixed_distinct_and_deterministic():
    names = ["tvm", "dnnl", "mkl", "onnxruntime", "openvino", "cublas", "cudnn", "tensorrt",
             "inductor"]
    assert show.backend_colours(names) == {b: show.BACKEND_COLOURS[b] for b in names}
    assert len(set(show.BACKEND_COLOURS.values())) == len(show.BACKEND_COLOURS)
    others = ["alpha", "beta", "gamma", "delta"]
    first = show.backend_colours(["tvm", *others])
    assert first == show.backend_colours(list(reversed(others)) + ["tvm"])
    assert len(set(first.values())) == len(first)
    assert all(first[b] in show.FALLBACK_COLOURS for b in others)


def test_layout_chain_runs_straight_down_and_nodes_never_overlap():
    chain = show.layout([[]] + [[i] for i in range(199)], [60.0] * 200)
    assert len(set(chain.x)) == 1
    assert all(b - a == show.ROW for a, b in zip(chain.y, chain.y[1:]))

    rng = random.Random(0)
    inputs = [[]] + [sorted(rng.sample(range(i), min(i, rng.choice([1, 1, 2, 3]))))
                     for i in range(1, 400)]
    widths = [rng.choice([44.0, 70.0, 120.0]) for _ in inputs]
    lay = show.layout(inputs, widths)
    for c, ins in enumerate(inputs):
        assert all(lay.y[p] < lay.y[c] for p in ins)
    by_row: dict = {}
    for i, y in enumerate(lay.y):
        by_row.setdefault(y, []).append(i)
    for row in by_row.values():
        row.sort(key=lambda i: lay.x[i])
        for a, b in zip(row, row[1:]):
            assert lay.x[b] - lay.x[a] >= (widths[a] + widths[b]) / 2 + show.GAP - 1e-6
    assert min(lay.x[i] - widths[i] / 2 for i in range(len(inputs))) >= -1e-6
    assert max(lay.x[i] + widths[i] / 2 for i in range(len(inputs))) <= lay.width + 1e-6
