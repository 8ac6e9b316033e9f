"""Graph rewrites before placement (issue #18): substitutions proved with z3 from operator
axioms (``verify``), each checked numerically with TVM (``numeric``), applied as Relax passes
(``passes``: each at one site at a time), found by the generator (``generator``: TASO's
enumerate, fingerprint, prune, verify; what it proved is ``generated_rules``, matched and
applied in Relax by ``generated``), chosen by the cost-based backtracking search
(``backtrack``: a priority queue with relaxation alpha, over a cost function the caller gives).
``rewrite=True`` in the build applies the fold of a convolution's per-channel affine tail
(bias, batch norm decomposed for inference), which only removes work, then the search,
each graph costed by the op-level DP over the build's measured candidates; the final check
(``compare=True``) times the unrewritten graph's placement too. The search runs on the graph
split into pieces (``split``, MetaFlow Alg. 2)."""
from .passes import fold_conv_affine
from .substitutions import SUBSTITUTIONS, WRONG, by_name, prove

__all__ = ["fold_conv_affine", "SUBSTITUTIONS", "WRONG", "by_name", "prove"]
