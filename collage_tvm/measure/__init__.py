"""Measuring candidate kernels and caching what was measured.

Collage (paper §4) costs every candidate by building and timing it on the target
device; those costs are expensive to obtain, so they are kept in a persistent
cost database (:mod:`collage_tvm.measure.db`) keyed by backend, backend version,
a structural hash of the candidate, and the device.

One concern a module:

- ``measurer``: the cost cache (``Measurer``): a candidate's DB key, the DB's answer, or a
  measurement; ``keys``: the suffixes and special keys of the DB's rows;
- ``timers``: where a candidate is timed (this process, the measuring child, RPC servers),
  chosen once per measurer; ``runner``: the build-and-time entry points a timer runs;
  ``worker``: the measuring child; ``remote``: the RPC servers;
- ``timing``: the timing loops every stage uses; ``other_load``: the machine's other work
  while it times; ``cuda_graph``: a whole executable as one CUDA graph;
- ``switch``: switch costs between backends; ``side_by_side``: candidates re-timed side by
  side; ``builds``: build processes ahead of the timing; ``verdicts``: a lean search's
  verdict in the DB; ``estimate``: a candidate's work, the roofline's lower bounds;
- ``db``: the SQLite cost DB; ``records``: a record, failure kinds, the export format;
  ``progress``: progress bars.
"""
