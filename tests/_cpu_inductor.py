"""The inductor lowering on the CPU (``torch.compile``'s C++ backend), importable by build and
measuring processes: the test of libraries whose builds leave a cache on disk."""
from collage_tvm.backends.inductor import InductorLowering


class InductorOnCpu(InductorLowering):
    name = "cpu_inductor"
    device = "cpu"
