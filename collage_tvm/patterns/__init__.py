"""The kit pattern files are written with: epilogue groups for operator libraries
(``epilogue``) and the rule graph libraries share (``graph_rule``). The candidate generator
that expands the pattern files over a graph is ``collage_tvm.candidates``."""
