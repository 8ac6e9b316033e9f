"""Measuring candidate kernels and caching what was measured.

Collage (paper §4) costs every candidate by building and timing it on the target
device; those costs are expensive to obtain, so they are kept in a persistent
cost database (:mod:`collage_tvm.measure.db`) keyed by backend, backend version,
a structural hash of the candidate, and the device.
"""
