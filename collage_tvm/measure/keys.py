"""The cost DB's keys beyond a candidate's own (``graph.subgraph.function_key``): the
suffixes that say how a candidate was timed, and the keys of rows that hold no candidate.

Every string here is part of the keys of the cost DBs on disk: changed, none of their rows
would be found again. A new way of timing takes a new string; the old one stays as it is
(a name may change, its value may not).
"""
from __future__ import annotations

# A backend's call overhead (the paper's epsilon, Eq. 2): the time of its probe kernel
# (``measurer.probe_function``), under this key. The string is from before the name.
CALL_OVERHEAD_KEY = "__epsilon__"

# The suffix of a candidate's key when it is timed with cold caches (``Measurer.costs``).
# "|cold2": since the flush runs on every core (``timing._Flush``); costs after TVM's own
# flush ("|cold") ran higher (ViT-B/16's OpenVINO region 238 ms against 162) and are not
# mixed with these.
COLD_KEY = "|cold2"
WHOLE_KEY = "|whole"  # the suffix of a candidate's key when it is the whole model

# The cost model's revision, part of the placement-log key (``build.placement_key``): a
# placement searched on costs the measurer no longer gives is searched again (most of its
# costs come back from the DB). "cold": large candidates timed with cold caches (2026-11-25);
# "cold2": after a flush on every core (``COLD_KEY``, 2026-11-28); "cold2-look": a first
# run near the cutoff gets a second look (``timing.SECOND_LOOK_MS``) and the costs cut on
# such a run before are measured again (``timing.cut_before_second_look``), 2026-11-29.
COST_MODEL = "cold2-look"

# The switch cost of a pair of backends (``switch.switch_costs``): the row of backend ``a``,
# version "<a's>|<b's>", key "__switch__:<b>".
SWITCH_KEY = "__switch__"
# A set of candidates timed side by side (``side_by_side.retime``): "__side_by_side__:<hash
# of its members>".
SIDE_KEY = "__side_by_side__"
# A lean search's verdict: which candidates it left unmeasured (``verdicts.keep_skipped``).
LEAN_KEY = "__lean__"
