"""Graph rewrites before placement (issue #18): substitutions proved with z3 from operator
axioms (``verify``), each checked numerically with TVM (``numeric``), applied as Relax passes
(``passes``), and found by the generator (``generator``: TASO's enumerate, fingerprint,
prune, verify). First step: the substitutions and their proofs, the generator, and the pass
that folds a convolution's per-channel affine tail (bias, batch norm decomposed for
inference) into its weights, applied by ``rewrite=True``. Not yet: the cost-based search
that would apply the others, graph split, ``bench --rewrite``."""
from .passes import fold_conv_affine
from .substitutions import SUBSTITUTIONS, WRONG, by_name, prove

__all__ = ["fold_conv_affine", "SUBSTITUTIONS", "WRONG", "by_name", "prove"]
