"""``collage-tvm show``: draw a placement record as the model's dataflow graph (paper Fig. 12).

Each operator is a rounded box labelled with its short op name and filled with the colour
of the backend that runs it; a group of more than one node (one fused kernel or library
call) gets a dashed box naming its backend. One layered layout (``layout``: layer = longest
path from an input, barycenter sweeps against crossings) feeds three writers: hand-written
SVG, a standalone HTML page around that SVG (hover a node for its details) and a PNG drawn
with matplotlib's Agg backend. No external tool (graphviz) is needed; the PNG needs
matplotlib (``pip install 'collage-tvm[plot]'``), SVG and HTML need nothing.
"""
from __future__ import annotations

import bisect
import html
import json
import math
import os
import zlib
from dataclasses import dataclass, field

from collage_tvm.tools import need_matplotlib

# Fixed colours of the well-known backends; others get one of FALLBACK_COLOURS by name.
BACKEND_COLOURS = {
    "tvm": "#80b1d3", "dnnl": "#fdb462", "mkl": "#b3de69", "onnxruntime": "#bebada",
    "openvino": "#fb8072", "cublas": "#ffed6f", "cudnn": "#8dd3c7", "tensorrt": "#fccde5",
    "inductor": "#ee854a",
}
FALLBACK_COLOURS = ("#ccebc5", "#bc80bd", "#d9d9d9", "#e5c494", "#9edae5", "#c49c94",
                    "#dbdb8d", "#ff9896")

FONT_FAMILY = "DejaVu Sans, Verdana, Arial, sans-serif"  # matplotlib's default font first
FONT = 11          # node label size (px)
NODE_H = 20        # node box height (px)
MIN_NODE_W = 44
ROW = 44           # distance between layers (px)
GAP = 16           # horizontal gap between neighbouring nodes (px)
EDGE_GAP = 12      # horizontal gap next to an edge passing through a layer (px)
DUMMY_WEIGHT = 0.05  # pull of a long edge's bend point on x positions, against a node's 1
STAGE_COLOUR = "#6a3d9a"  # a concurrent stage's box and label
STAGE_FILL = "#f3eef8"
GROUP_PAD = 5      # dashed group box around its nodes (px)
MARGIN = 20
PX_PER_INCH = 100  # PNG: one scene pixel is one image pixel ...
MAX_PNG_PX = 32000  # ... unless the picture is taller than this: then it is scaled down


# ---------------------------------------------------------------------------- the record


def load_record(path) -> dict:
    """Read and check a placement JSON written by ``collage-tvm optimize MODEL -o``.

    Raises ValueError with a message naming the file and the problem.
    """
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror})") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not JSON ({err})") from None
    check_record(record, str(path))
    return record


def check_record(record, name: str = "the placement record") -> None:
    """Raise ValueError unless ``record`` has a graph whose nodes its groups cover once each."""
    if not isinstance(record, dict) or not isinstance(record.get("groups"), list):
        raise ValueError(f"{name} is not a placement record (no \"groups\" list); write one "
                         "with `collage-tvm optimize MODEL -o FILE`")
    if "graph" not in record:
        raise ValueError(f"{name} has no \"graph\": it was written by an older collage-tvm. "
                         f"Re-run `collage-tvm optimize MODEL -o {name}` with this version "
                         "to record the dataflow graph, then show it again")
    try:
        nodes = record["graph"]["nodes"]
        inputs = [[int(p) for p in n["inputs"]] for n in nodes]
        if not all(isinstance(n["op"], str) for n in nodes):
            raise TypeError("an \"op\" is not a string")
        outputs = [int(i) for i in record["graph"].get("outputs", [])]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{name}: malformed \"graph\" (each node needs \"op\" and "
                         f"\"inputs\"): {type(err).__name__} {err}") from None
    n = len(nodes)
    if n == 0:
        raise ValueError(f"{name}: the graph has no nodes")
    for i, ins in enumerate(inputs):
        for p in ins:
            if not 0 <= p < i:
                raise ValueError(f"{name}: node {i} reads node {p}, which is not an earlier "
                                 "node of the graph (nodes must be in topological order)")
    if any(not 0 <= i < n for i in outputs):
        raise ValueError(f"{name}: graph outputs {outputs} name nodes outside 0..{n - 1}")
    owner: dict = {}
    for k, g in enumerate(record["groups"]):
        try:
            backend, members = str(g["backend"]), [int(i) for i in g["nodes"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{name}: group {k} is malformed (needs \"backend\" and "
                             f"\"nodes\"): {type(err).__name__} {err}") from None
        for i in members:
            if not 0 <= i < n:
                raise ValueError(f"{name}: group {k} ({backend}) names node {i}, but the "
                                 f"graph has {n} nodes")
            if i in owner:
                raise ValueError(f"{name}: node {i} is in two groups ({owner[i]} and {k})")
            owner[i] = k
    for k, stage in enumerate(record.get("stages") or []):
        try:
            named = [int(g) for chain in stage for g in chain]
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: stage {k} is malformed (a list of chains of group "
                             f"indices): {type(err).__name__} {err}") from None
        if len(stage) < 2 or any(not 0 <= g < len(record["groups"]) for g in named):
            raise ValueError(f"{name}: stage {k} names groups outside 0.."
                             f"{len(record['groups']) - 1} or has fewer than two chains")
    missing = [i for i in range(n) if i not in owner]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ValueError(f"{name}: the groups do not cover {len(missing)} of the graph's {n} "
                         f"nodes (node {shown})")


def backend_colours(backends) -> dict:
    """Backend -> fill colour: fixed for the well-known ones; others by a hash of the name,
    moving on through FALLBACK_COLOURS past colours already taken in this picture."""
    names = sorted(set(backends))
    colours = {b: BACKEND_COLOURS[b] for b in names if b in BACKEND_COLOURS}
    for b in names:
        if b in colours:
            continue
        start = zlib.crc32(b.encode()) % len(FALLBACK_COLOURS)
        ring = FALLBACK_COLOURS[start:] + FALLBACK_COLOURS[:start]
        colours[b] = next((c for c in ring if c not in colours.values()), ring[0])
    return colours


def short_op(op: str) -> str:
    """``relax.nn.conv2d`` -> ``conv2d``; other names (``call:...``) cut to 24 characters."""
    if op.startswith("relax."):
        return op.rsplit(".", 1)[-1]
    return op if len(op) <= 24 else op[:23] + "\u2026"


# ---------------------------------------------------------------------------- the layout


@dataclass
class Layout:
    """Node centres and edge routes in pixels; the graph's box starts at (0, 0)."""

    x: list        # centre x of each node
    y: list        # centre y of each node
    edges: list    # (producer, consumer, points from the producer's bottom to the consumer's top)
    width: float
    height: float


def layout(inputs: list, widths: list) -> Layout:
    """Layered layout of a DAG given each node's producers (earlier indices) and box width.

    Layer = longest path from an input (a node reading only parameters sits just above its
    first consumer); an edge spanning layers passes through one dummy point per layer, so
    long edges route around nodes. Barycenter sweeps order each layer (the order with the
    fewest crossings is kept); x positions then pull every node towards its neighbours'
    mean, keeping the order and the gaps (isotonic regression), so chains run straight down
    and long edges bend around them.
    """
    n = len(inputs)
    users: list = [[] for _ in range(n)]
    for c, ins in enumerate(inputs):
        for p in ins:
            users[p].append(c)
    layer = [0] * n
    for i in range(n):
        layer[i] = 1 + max((layer[p] for p in inputs[i]), default=-1)
    for i in range(n):
        if not inputs[i] and users[i]:
            layer[i] = min(layer[u] for u in users[i]) - 1
    # Vertices: the nodes, then one dummy per edge per layer it passes through.
    vlayer, vwidth = list(layer), [float(w) for w in widths]
    up: list = [[] for _ in range(n)]
    down: list = [[] for _ in range(n)]
    chains = []
    for c in range(n):
        for p in inputs[c]:
            chain = [p]
            for lay in range(layer[p] + 1, layer[c]):
                vlayer.append(lay)
                vwidth.append(0.0)
                up.append([])
                down.append([])
                chain.append(len(vlayer) - 1)
            chain.append(c)
            for a, b in zip(chain, chain[1:]):
                down[a].append(b)
                up[b].append(a)
            chains.append((p, c, chain))
    rows: list = [[] for _ in range(max(vlayer, default=-1) + 1)]
    for v, lay in enumerate(vlayer):
        rows[lay].append(v)
    rows = _order(rows, up, down)
    x = _x_positions(rows, up, down, vwidth, n)
    left = min((x[v] - vwidth[v] / 2 for v in range(len(x))), default=0.0)
    x = [xv - left for xv in x]
    y = [lay * ROW + NODE_H / 2 for lay in vlayer]
    edges = [(p, c, [(x[p], y[p] + NODE_H / 2), *((x[d], y[d]) for d in chain[1:-1]),
                     (x[c], y[c] - NODE_H / 2)])
             for p, c, chain in chains]
    width = max((x[v] + vwidth[v] / 2 for v in range(len(x))), default=0.0)
    return Layout(x[:n], y[:n], edges, width, max(0, len(rows) * ROW - (ROW - NODE_H)))


def _order(rows: list, up: list, down: list, sweeps: int = 12) -> list:
    """Alternate down/up barycenter sweeps; return the ordering with the fewest crossings."""
    pos = [0] * len(up)

    def renumber(row):
        for k, v in enumerate(row):
            pos[v] = k

    for row in rows:
        renumber(row)
    best, fewest = [list(r) for r in rows], _crossings(rows, down, pos)
    for sweep in range(sweeps):
        if fewest == 0:
            break
        downward = sweep % 2 == 0
        nbrs = up if downward else down
        for lay in (range(1, len(rows)) if downward else range(len(rows) - 2, -1, -1)):
            rows[lay].sort(key=lambda v: (sum(pos[u] for u in nbrs[v]) / len(nbrs[v])
                                          if nbrs[v] else pos[v], pos[v]))
            renumber(rows[lay])
        crossings = _crossings(rows, down, pos)
        if crossings < fewest:
            best, fewest = [list(r) for r in rows], crossings
    return best


def _crossings(rows: list, down: list, pos: list) -> int:
    """Edge crossings between consecutive layers (inversions of the lower ends)."""
    total = 0
    for row in rows[:-1]:
        seen: list = []
        for _, lower in sorted((pos[a], pos[b]) for a in row for b in down[a]):
            total += len(seen) - bisect.bisect_right(seen, lower)
            bisect.insort(seen, lower)
    return total


def _x_positions(rows: list, up: list, down: list, width: list, n_nodes: int,
                 rounds: int = 6) -> list:
    """x of every vertex: sweeps towards the neighbours' weighted mean, order and gaps kept.

    Dummies (points of long edges) weigh DUMMY_WEIGHT against a node's 1, so nodes line up
    with the nodes they feed and read, and long edges bend around them.
    """
    x = [0.0] * len(width)
    weight = [1.0 if v < n_nodes else DUMMY_WEIGHT for v in range(len(width))]

    def place(row, nbrs_of):
        desired = []
        for v in row:
            nbrs = nbrs_of(v)
            total = sum(weight[u] for u in nbrs)
            desired.append(sum(weight[u] * x[u] for u in nbrs) / total if nbrs else x[v])
        gaps = [(width[a] + width[b]) / 2 + (GAP if a < n_nodes and b < n_nodes else EDGE_GAP)
                for a, b in zip(row, row[1:])]
        for v, xv in zip(row, _fit(desired, [weight[v] for v in row], gaps)):
            x[v] = xv

    for row in rows:
        place(row, lambda v: [])
    for _ in range(rounds):
        for row in rows[1:]:
            place(row, lambda v: up[v])
        for row in reversed(rows[:-1]):
            place(row, lambda v: down[v])
    for row in rows:
        place(row, lambda v: up[v] + down[v])
    return x


def _fit(desired: list, weights: list, gaps: list) -> list:
    """Positions closest (weighted least squares) to ``desired`` keeping the order and at
    least ``gaps`` between neighbours: pool-adjacent-violators on ``desired - cumulative gaps``."""
    offsets = [0.0]
    for g in gaps:
        offsets.append(offsets[-1] + g)
    blocks: list = []  # [weighted mean, weight, count]
    for d, w, o in zip(desired, weights, offsets):
        blocks.append([d - o, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    means = [m for m, _, c in blocks for _ in range(c)]
    return [m + o for m, o in zip(means, offsets)]


# ---------------------------------------------------------------------------- the scene


@dataclass
class Rect:
    """A rectangle; (x, y) is its top-left corner."""

    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str
    width: float = 1.0
    dashed: bool = False
    radius: float = 0.0


@dataclass
class Text:
    """One line of text, anchored at its middle or its start."""

    x: float
    y: float          # vertical centre
    text: str
    size: float
    anchor: str = "middle"  # or "start"
    colour: str = "#1a1a1a"
    bold: bool = False
    halo: bool = False      # white outline, readable over edges


@dataclass
class Curve:
    """An edge: a smooth line through ``points``."""

    points: list  # passes through each point, vertical at each (cubic Bezier pieces)
    colour: str
    width: float = 1.0


@dataclass
class Polygon:
    """A filled polygon (an edge's arrowhead)."""

    points: list
    colour: str


@dataclass
class Item:
    """One thing in the picture: a node, a group box, an edge, a legend row, the title."""

    cls: str
    shapes: list
    tooltip: str = ""
    data: dict = field(default_factory=dict)  # SVG data-* attributes


@dataclass
class Scene:
    """The whole picture, in pixels; each writer draws its items in order."""

    width: int
    height: int
    title: str
    items: list  # drawn in this order


def scene(record: dict) -> Scene:
    """Everything to draw for a checked placement record, in pixels."""
    nodes, groups = record["graph"]["nodes"], record["groups"]
    outputs = set(record["graph"].get("outputs", []))
    owner = {int(i): k for k, g in enumerate(groups) for i in g["nodes"]}
    colours = backend_colours(g["backend"] for g in groups)
    labels = [short_op(nd["op"]) for nd in nodes]
    node_w = [max(MIN_NODE_W, _text_w(s, FONT) + 14) for s in labels]
    lay = layout([[int(p) for p in nd["inputs"]] for nd in nodes], node_w)

    title, items, header_w, header_bottom = _header(record, colours)
    width = math.ceil(max(lay.width + 2 * GROUP_PAD, header_w) + 2 * MARGIN)
    top = header_bottom + 30  # room for the first group box's label
    ox = (width - lay.width) / 2
    px = [ox + v for v in lay.x]
    py = [top + v for v in lay.y]

    for k, stage in enumerate(record.get("stages") or []):
        members = [int(i) for chain in stage for g in chain for i in groups[int(g)]["nodes"]]
        pad = 2.2 * GROUP_PAD
        x0 = min(px[i] - node_w[i] / 2 for i in members) - pad
        x1 = max(px[i] + node_w[i] / 2 for i in members) + pad
        y0 = min(py[i] for i in members) - NODE_H / 2 - pad
        y1 = max(py[i] for i in members) + NODE_H / 2 + pad
        text = f"stage {k}: {len(stage)} groups at once"
        items.append(Item("stage", [Rect(x0, y0, x1 - x0, y1 - y0, STAGE_FILL, STAGE_COLOUR,
                                         2.0, False, 8),
                                    Text(x0 + 2, y0 - 7, text, 9, "start", STAGE_COLOUR,
                                         halo=True)],
                          tooltip=text + ", each on its share of the cores: " + "; ".join(
                              " then ".join(f"group {int(g)} ({groups[int(g)]['backend']})"
                                            for g in chain) for chain in stage),
                          data={"stage": str(k)}))
    for k, g in enumerate(groups):
        members = sorted(int(i) for i in g["nodes"])
        if len(members) < 2:
            continue
        x0 = min(px[i] - node_w[i] / 2 for i in members) - GROUP_PAD
        x1 = max(px[i] + node_w[i] / 2 for i in members) + GROUP_PAD
        y0 = min(py[i] for i in members) - NODE_H / 2 - GROUP_PAD
        y1 = max(py[i] for i in members) + NODE_H / 2 + GROUP_PAD
        dark = _darker(colours[g["backend"]])
        items.append(Item("group", [Rect(x0, y0, x1 - x0, y1 - y0, "none", dark, 1.3, True, 4),
                                    Text(x0 + 2, y0 - 7, g["backend"], 9, "start", dark,
                                         halo=True)],
                          tooltip=f"{g['backend']} kernel {k}: {g.get('label', '')} "
                                  f"({g.get('level', 'op-level')}, {len(members)} nodes: "
                                  f"{', '.join(map(str, members))})",
                          data={"backend": g["backend"], "group": str(k)}))
    for p, c, pts in lay.edges:
        pts = [(ox + a, top + b) for a, b in pts]
        tx, ty = pts[-1]
        items.append(Item("edge", [Curve(pts, "#8a8a8a"),
                                   Polygon([(tx - 3.5, ty - 6), (tx + 3.5, ty - 6), (tx, ty)],
                                           "#8a8a8a")],
                          data={"from": str(p), "to": str(c)}))
    for i, nd in enumerate(nodes):
        g = groups[owner[i]]
        fill = colours[g["backend"]]
        shape = nd.get("shape")
        tooltip = "\n".join([
            f"{labels[i]}: node {i} ({nd['op']}){', graph output' if i in outputs else ''}",
            f"shape: {'x'.join(map(str, shape)) if shape else 'unknown (tuple or symbolic)'}",
            f"group {owner[i]}: {g.get('label', '')} on {g['backend']} "
            f"({g.get('level', 'op-level')}, {_count(len(g['nodes']), 'node')})"])
        items.append(Item("node", [Rect(px[i] - node_w[i] / 2, py[i] - NODE_H / 2, node_w[i],
                                        NODE_H, fill, _darker(fill),
                                        2.0 if i in outputs else 1.0, radius=6),
                                   Text(px[i], py[i], labels[i], FONT)],
                          tooltip=tooltip, data={"node": str(i), "backend": g["backend"]}))
    return Scene(width, math.ceil(top + lay.height + MARGIN), title, items)


def _header(record: dict, colours: dict) -> tuple:
    """(title, items, width, bottom y) of the header: the title, a summary line and the
    legend (one row per backend with its kernel and op counts, then what dashed boxes and
    thick outlines mean)."""
    nodes, groups = record["graph"]["nodes"], record["groups"]
    shipped = record.get("shipped", "collage")
    ms = (record.get("comparison") or {}).get(shipped, {}).get("ms")
    title = f"Collage placement, shipped build: {shipped}"
    if isinstance(ms, (int, float)) and math.isfinite(ms):
        title += f" ({ms:.3f} ms)"
    fused = sum(1 for g in groups if len(g["nodes"]) > 1)
    stages = record.get("stages") or []
    summary = (f"{_count(len(nodes), 'operator')} in {_count(len(groups), 'kernel')}, "
               f"{_count(fused, 'fused group')} boxed"
               + (f", {_count(len(stages), 'concurrent stage')}" if stages else "")
               + f"; target {record.get('target', '?')}")
    items = [Item("title", [Text(MARGIN, MARGIN + 8, title, 14, "start", bold=True)]),
             Item("summary", [Text(MARGIN, MARGIN + 30, summary, FONT, "start")])]
    lines, y = [summary], MARGIN + 54
    for b in sorted(colours):
        mine = [g for g in groups if g["backend"] == b]
        graph_level = sum(1 for g in mine if g.get("level") == "graph-level")
        text = (f"{b}: {_count(len(mine), 'kernel')}, "
                f"{_count(sum(len(g['nodes']) for g in mine), 'op')}"
                + (f" ({graph_level} chosen by the graph-level search)" if graph_level else ""))
        items.append(Item("legend", [Rect(MARGIN, y - 7, 24, 14, colours[b], _darker(colours[b]),
                                          radius=3),
                                     Text(MARGIN + 32, y, text, FONT, "start")],
                          data={"backend": b, "colour": colours[b]}))
        lines.append(text)
        y += 20
    for swatch, text in [
            (Rect(MARGIN, y - 7, 24, 14, "none", "#555", dashed=True),
             "dashed box: one kernel or library call running several operators"),
            (Rect(MARGIN, y + 13, 24, 14, "#eeeeee", "#555", 2.0, radius=3),
             "thick outline: a graph output")] + ([
            (Rect(MARGIN, y + 33, 24, 14, STAGE_FILL, STAGE_COLOUR, 2.0, radius=3),
             "shaded box: a stage whose groups run at the same time")] if stages else []):
        items.append(Item("legend-note", [swatch, Text(MARGIN + 32, swatch.y + 7, text, FONT,
                                                       "start")]))
        lines.append(text)
    width = max([_text_w(title, 14, bold=True)] + [32 + _text_w(t, FONT) for t in lines])
    return title, items, width, y + (50 if stages else 30)


def _text_w(text: str, size: float, bold: bool = False) -> float:
    """Estimated width (px) of ``text`` in DejaVu Sans at ``size`` px."""
    return len(text) * size * (0.68 if bold else 0.62)


def _count(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _darker(colour: str, f: float = 0.55) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"#{int(r * f):02x}{int(g * f):02x}{int(b * f):02x}"


def _bezier(points: list) -> list:
    """Cubic pieces (p0, c0, c1, p1) through ``points``, vertical at every point."""
    pieces = []
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        ym = (y0 + y1) / 2
        pieces.append(((x0, y0), (x0, ym), (x1, ym), (x1, y1)))
    return pieces


# ---------------------------------------------------------------------------- the writers


def render(record: dict, path: str) -> str:
    """Draw ``record`` to ``path``: .svg, .html or .png by its extension. Returns ``path``.
    A .png without matplotlib installed raises ``MissingPlotExtra`` (an ImportError)."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in (".svg", ".html", ".png"):
        raise ValueError(f"{path}: cannot tell the picture format from {ext or 'no extension'}; "
                         "use .svg, .html or .png")
    check_record(record)
    sc = scene(record)
    if ext == ".png":
        to_png(sc, path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_svg(sc) if ext == ".svg" else to_html(sc))
    return str(path)


def to_svg(sc: Scene) -> str:
    """The scene as a standalone SVG document (tooltips as <title> elements)."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{sc.width}" height="{sc.height}" '
           f'viewBox="0 0 {sc.width} {sc.height}" font-family="{FONT_FAMILY}">',
           f"<title>{_esc(sc.title)}</title>",
           '<rect width="100%" height="100%" fill="white"/>']
    for item in sc.items:
        data = "".join(f' data-{k}="{_esc(v)}"' for k, v in item.data.items())
        out.append(f'<g class="{item.cls}"{data}>')
        if item.tooltip:
            out.append(f"<title>{_esc(item.tooltip)}</title>")
        out += [_svg_shape(s) for s in item.shapes]
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_shape(s) -> str:
    if isinstance(s, Rect):
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        return (f'<rect x="{s.x:.1f}" y="{s.y:.1f}" width="{s.w:.1f}" height="{s.h:.1f}" '
                f'rx="{s.radius:g}" fill="{s.fill}" stroke="{s.stroke}" '
                f'stroke-width="{s.width:g}"{dash}/>')
    if isinstance(s, Text):
        extra = (' font-weight="bold"' if s.bold else "") + (
            ' stroke="white" stroke-width="3" paint-order="stroke"' if s.halo else "")
        return (f'<text x="{s.x:.1f}" y="{s.y:.1f}" font-size="{s.size:g}" '
                f'text-anchor="{s.anchor}" dominant-baseline="central" fill="{s.colour}"'
                f"{extra}>{_esc(s.text)}</text>")
    if isinstance(s, Curve):
        d = f"M{s.points[0][0]:.1f},{s.points[0][1]:.1f}" + "".join(
            " C" + " ".join(f"{a:.1f},{b:.1f}" for a, b in piece[1:])
            for piece in _bezier(s.points))
        return f'<path d="{d}" fill="none" stroke="{s.colour}" stroke-width="{s.width:g}"/>'
    return (f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in s.points)}" '
            f'fill="{s.colour}"/>')


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def to_html(sc: Scene) -> str:
    """A standalone page around the SVG; hovering a node or a box shows its details."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{_esc(sc.title)}</title>
<style>
body {{ font-family: {FONT_FAMILY}; margin: 16px; color: #1a1a1a; }}
.node, .group {{ cursor: default; }}
.node:hover rect {{ stroke-width: 3; }}
.group:hover rect {{ stroke-width: 2.5; }}
</style>
</head>
<body>
<p>Hover a node for its operator, index, shape and group; hover a dashed box for its kernel.</p>
{to_svg(sc)}</body>
</html>
"""


def to_png(sc: Scene, path: str) -> None:
    """Draw the scene with matplotlib (Agg, no pyplot state) to a PNG at ``path``."""
    need_matplotlib("a .png placement picture (.svg and .html need nothing)")
    from matplotlib import patheffects
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, PathPatch, Polygon as MplPolygon, Rectangle
    from matplotlib.path import Path

    fig = Figure(figsize=(sc.width / PX_PER_INCH, sc.height / PX_PER_INCH))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, sc.width)
    ax.set_ylim(sc.height, 0)
    ax.set_axis_off()
    pt = 72 / PX_PER_INCH  # points per scene pixel
    for z, item in enumerate(sc.items):
        for s in item.shapes:
            if isinstance(s, Rect):
                style = dict(facecolor="none" if s.fill == "none" else s.fill, edgecolor=s.stroke,
                             linewidth=s.width * pt, zorder=z,
                             linestyle=(0, (5, 3)) if s.dashed else "-")
                ax.add_patch(FancyBboxPatch((s.x, s.y), s.w, s.h, mutation_aspect=1,
                                            boxstyle=f"round,pad=0,rounding_size={s.radius}",
                                            **style) if s.radius else
                             Rectangle((s.x, s.y), s.w, s.h, **style))
            elif isinstance(s, Text):
                ax.text(s.x, s.y, s.text, fontsize=s.size * pt, color=s.colour, zorder=z,
                        ha="center" if s.anchor == "middle" else "left", va="center",
                        fontweight="bold" if s.bold else "normal",
                        path_effects=[patheffects.withStroke(linewidth=3 * pt,
                                                             foreground="white")]
                        if s.halo else None)
            elif isinstance(s, Curve):
                pieces = _bezier(s.points)
                verts = [s.points[0]] + [p for piece in pieces for p in piece[1:]]
                codes = [Path.MOVETO] + [Path.CURVE4] * (3 * len(pieces))
                ax.add_patch(PathPatch(Path(verts, codes), fill=False, edgecolor=s.colour,
                                       linewidth=s.width * pt, zorder=z))
            else:
                ax.add_patch(MplPolygon(s.points, closed=True, facecolor=s.colour,
                                        edgecolor="none", zorder=z))
    fig.savefig(path, dpi=PX_PER_INCH * min(1.0, MAX_PNG_PX / max(sc.width, sc.height)),
                facecolor="white", format="png")
