"""A lowering that kills its process (SIGSEGV) when asked to compile anything: the test of
measurement isolation; and build functions of other tests. Lives in its own module so the
measurement worker can import it."""


class SegfaultingLowering:
    def available(self):
        return True, ""

    def version(self):
        return "segfault-1"

    def lower(self, func):
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV


def build_vm_refusing_sigmoid(func, backend, target, tuning=None, executable=False):
    """``lower.candidate_vm``, except that a build process (``executable=True``) fails on a
    function with a sigmoid: the test of a build that fails in a build process."""
    from collage_tvm.byoc import candidate_vm

    if executable and "sigmoid" in func.script():
        raise RuntimeError("this build process refuses sigmoid")
    return candidate_vm(func, backend, target, tuning=tuning, executable=executable)


def build_vm_logging(func, backend, target, tuning=None, executable=False):
    """``lower.candidate_vm``, writing a line to the file ``COLLAGE_TEST_BUILD_LOG`` names
    for each build: the test that a measuring child builds again for another measurer."""
    import os

    from collage_tvm.byoc import candidate_vm

    with open(os.environ["COLLAGE_TEST_BUILD_LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return candidate_vm(func, backend, target, tuning=tuning, executable=executable)


def lowered_in_this_process(funcs, target):
    """``measure.runner.run_callback``'s reply: how many lowered library callables
    (``byoc.external``'s cache) the measuring child holds."""
    from collage_tvm.byoc import external

    return float(len(external._CACHE)), None, {}
