"""A build taken away: ``save`` writes a directory, ``load`` runs it in another process.

``collage_tvm.save(result, DIR)`` (``collage-tvm optimize ... --export DIR``) writes::

    DIR/manifest.json      format version, versions (collage-tvm, TVM, each library), the
                           target and the CPU features it needs, inputs and outputs, the
                           placement, the accuracy budget, the measured latencies, and the
                           size of every file below
    DIR/kernels.so         TVM's kernels and the Relax VM's code (``export_library``)
    DIR/regions/rK.onnx    a graph library's region as the file the library loads (weights
                           inside; past protobuf's 2 GiB beside it, rK.onnx.weights)
    DIR/regions/rK.json    any other library's region: its Relax function with its
                           weights (``tvm.ir.save_json``), lowered again by the library
    DIR/regions/model_file.onnx  the user's model file, where the alternates at load may run
                           it or a dynamic model's dispatch runs it per shape (if any)
    DIR/static/            a dynamic model's static build at the optimum, an artifact of
                           its own (if any)
    DIR/placement.json     the placement record ``collage-tvm show`` draws (if any)

``collage_tvm.load(DIR)`` checks the manifest against this machine (format version, TVM
and library versions, CPU features, every file whole) and refuses with one
``ArtifactError`` naming the cause and what to install or rebuild; then each region is
handed to its library (an ONNX Runtime session, an OpenVINO compiled model, a oneDNN
kernel), registered under the symbol the executable calls, and the Relax VM is made over
``kernels.so``. Nothing is searched, compiled by TVM or timed at load. What the search
left close (the alternates between two graph libraries running one file whole, or the model
exported as one region and the user's own file; a dynamic model's libraries close at a
shape) is decided by the first calls in the serving process (``check.race``; the
alternates' libraries load in a thread; ``load(..., decide=False)`` keeps the search's
choices).

The VM binds the packed functions it calls when it is created, so the regions' callables
are registered only for that moment: a build of the same model in this process, or a
second load, keeps its own.

One layer a file: ``artifact.format`` (the manifest's name and version, the files' names,
``ArtifactError``, the CPU features recorded and checked), ``artifact.save`` (writing the
directory), ``artifact.load`` (reading it back: the checks, the regions, the alternates,
the VM) and ``artifact.loaded`` (``LoadedModule``, the loaded build's call). This
package's ``save`` and ``load`` are the functions, which hide the submodules of those
names: reach one with ``importlib.import_module("collage_tvm.artifact.load")``.
"""
from __future__ import annotations

from .format import (ALTERNATE_FILE, BF16_FEATURES, FORMAT, FORMAT_VERSION, KERNELS, MANIFEST,
                     PLACEMENT, REGIONS, STATIC, ArtifactError, _jsonable, host_cpu_features)
from .loaded import LoadedModule
from .load import alternate_label, load
from .save import _passes_through, save

__all__ = ["ArtifactError", "LoadedModule", "load", "save"]
