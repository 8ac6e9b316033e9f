"""The mkl backend's library binding: find ``libmkl_rt``, load it once through ctypes with
its signatures, and choose its threading layer before any other MKL call.

Why the GNU OpenMP layer on torch's ``libgomp.so.1`` (and never the Intel one): the
lowering's docstring (``__init__.py`` beside this file) and docs/DNNL_BINDING.md, "MKL
binding". The lowering imports what it calls from here; its GEMMs run on :class:`_Mkl`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import sys
import threading

# mkl_service.h / mkl_cblas.h
_THREADING = {0: "intel", 1: "sequential", 2: "pgi", 3: "gnu", 4: "tbb"}
MKL_THREADING_SEQUENTIAL, MKL_THREADING_GNU = 1, 3
CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112


def find_libmkl_rt() -> str | None:
    """Where ``libmkl_rt`` is: next to the interpreter's prefix (the wheel's data files),
    in the ``mkl`` distribution's file list, or on the system's library path."""
    names = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for name in names:
            path = os.path.join(prefix, "lib", name)
            if os.path.isfile(path):
                return path
    try:
        from importlib import metadata

        for f in metadata.files("mkl") or ():
            if os.path.basename(str(f)).startswith("libmkl_rt.so"):
                path = os.path.realpath(f.locate())
                if os.path.isfile(path):
                    return path
    except Exception:  # noqa: BLE001 - no mkl distribution: try the system next
        pass
    return ctypes.util.find_library("mkl_rt")


def _torch_libgomp() -> str | None:
    """torch's bundled ``libgomp.so.1`` (without importing torch), if torch is installed."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch")
    except Exception:  # noqa: BLE001
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        for cand in glob.glob(os.path.join(loc, "lib", "libgomp*.so*")):
            return cand
    return None


def _preload_libgomp() -> str | None:
    """Load the libgomp that MKL's GNU layer will bind to; None if there is none.

    If torch is (or will be) in the process, its bundled ``libgomp.so.1`` is loaded first, so
    the dynamic linker hands the same library (by soname) to MKL and, later, to torch.
    """
    cands = []
    if "torch" not in sys.modules:  # once torch is imported, its libgomp is already resident
        cands.append(_torch_libgomp())
    cands.append("libgomp.so.1")
    for cand in cands:
        if not cand:
            continue
        try:
            ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            return cand
        except OSError:
            continue
    return None


class _Mkl:
    """One loaded libmkl_rt: signatures, threading set up once, version."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.MKL_Set_Threading_Layer.argtypes, lib.MKL_Set_Threading_Layer.restype = [i], i
        lib.MKL_Set_Num_Threads.argtypes, lib.MKL_Set_Num_Threads.restype = [i], None
        lib.MKL_Set_Num_Threads_Local.argtypes, lib.MKL_Set_Num_Threads_Local.restype = [i], i
        lib.MKL_Get_Max_Threads.argtypes, lib.MKL_Get_Max_Threads.restype = [], i
        lib.MKL_Get_Version_String.argtypes, lib.MKL_Get_Version_String.restype = [ctypes.c_char_p, i], None
        lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        lib.cblas_sgemm.restype = None
        lib.cblas_sgemm_batch_strided.argtypes = [i, i, i, i, i, i, f, p, i, i, p, i, i, f, p, i, i, i]
        lib.cblas_sgemm_batch_strided.restype = None
        lib.cblas_gemm_bf16bf16f32.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        lib.cblas_gemm_bf16bf16f32.restype = None
        self.lib, self.path = lib, path
        # The threading layer must be chosen before any other MKL call (even the version
        # string initialises MKL, which then keeps the layer it detected).
        self.libgomp = _preload_libgomp()
        wanted = MKL_THREADING_GNU if self.libgomp else MKL_THREADING_SEQUENTIAL
        self.threading = _THREADING.get(lib.MKL_Set_Threading_Layer(wanted), "unknown")
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        self.version_string = buf.value.decode(errors="replace").strip()
        try:
            ncores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            ncores = os.cpu_count() or 1
        lib.MKL_Set_Num_Threads(max(1, ncores))
        self.threads = lib.MKL_Get_Max_Threads()
        self.set_num_threads_local = lib.MKL_Set_Num_Threads_Local
        self.tls = threading.local()  # .threads: the thread-local count this thread last set
        self.sgemm = lib.cblas_sgemm
        self.sgemm_batch_strided = lib.cblas_sgemm_batch_strided
        self.gemm_bf16 = lib.cblas_gemm_bf16bf16f32  # bf16 A and B, f32 C

    @property
    def version(self) -> str:
        found = re.search(r"Version\s+(\S+?)(?:-Product)?\s+Build\s+(\d+)", self.version_string)
        return f"{found.group(1)}-{found.group(2)}" if found else (self.version_string or "unknown")


_LIBS: dict = {}
_LOCK = threading.Lock()


def _load(path: str) -> _Mkl:
    with _LOCK:
        if path not in _LIBS:
            _LIBS[path] = _Mkl(path)
        return _LIBS[path]
