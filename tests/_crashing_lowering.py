"""A lowering that kills its process (SIGSEGV) when asked to compile anything: the test of
measurement isolation. Lives in its own module so the measurement worker can import it."""


class SegfaultingLowering:
    def available(self):
        return True, ""

    def version(self):
        return "segfault-1"

    def lower(self, func):
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
