"""Graph rewrites before placement (issue #18): substitutions proved with z3 from operator
axioms (``verify``), each checked numerically with TVM (``numeric``), applied as Relax passes
(``passes``). First step: the substitutions and their proofs, and the pass that folds a
convolution's per-channel affine tail (bias, batch norm decomposed for inference) into its
weights. Not yet: the substitution generator, the cost-based search, graph split, and
``rewrite=True`` in the build."""
from .passes import fold_conv_affine
from .substitutions import SUBSTITUTIONS, WRONG, by_name, prove

__all__ = ["fold_conv_affine", "SUBSTITUTIONS", "WRONG", "by_name", "prove"]
