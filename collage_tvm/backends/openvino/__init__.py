"""openvino backend (kind ``graph``): a Relax subgraph exported to ONNX, compiled by OpenVINO.

The ONNX bytes are read by OpenVINO's ONNX frontend and compiled for the CPU plugin with
the latency hint, as many inference threads as the process has cores, and the backend's
inference precision: ``openvino`` f32 (on CPUs with AMX/AVX512-BF16 the plugin otherwise
runs in bf16, its default there, which does not match the f32 reference);
``openvino_bf16`` bf16, placed only under an accuracy budget that allows it
(``collage_tvm.precision``). Either takes and returns f32 tensors. Inputs and outputs are OpenVINO tensors sharing memory with the
TVM buffers (``shared_memory=True``): nothing is copied.

This module is the backend's lowering; ``patterns.py`` beside it is its pattern file.
"""
from __future__ import annotations

import os

import numpy as np

from collage_tvm.backends._graphlib import (GraphLibraryLowering, as_numpy, model_source,
                                            new_output, single_or_tuple, threads)


def native_path(onnx_path: str) -> str:
    """Where ``OpenVinoLowering.save_native`` writes the IR of ``onnx_path``: r0.onnx ->
    r0.ov.xml (and r0.ov.bin)."""
    root = onnx_path[:-5] if onnx_path.endswith(".onnx") else onnx_path
    return root + ".ov.xml"


class OpenVinoLowering(GraphLibraryLowering):
    name = "openvino"
    precision = "f32"
    reads_files = True
    # OpenVINO compiles a model of static shapes into faster kernels than the same file with
    # dynamic axes: timm's ghostnet_100 with a dynamic batch on the AMX Xeon, 3.48 ms at
    # batch 1 compiled for it against 5.24 for the dynamic file, levit_128s 3.37 against
    # 4.23 (docs/results/suite_timm_dynamic_xeon_amx.json); ONNX Runtime ran the same
    # either way in a side-by-side check (resnet18, ghostnet_100, levit_128s)
    fixes_shapes = True

    def available(self) -> tuple[bool, str]:
        try:
            import openvino as ov

            if "CPU" not in ov.Core().available_devices:
                return False, "OpenVINO sees no CPU device"
            from collage_tvm.export import onnx as _export  # noqa: F401
        except Exception as err:  # noqa: BLE001 - available() never raises
            return False, f"{type(err).__name__}: {err}"
        return True, ""

    def version(self) -> str:
        try:
            import openvino as ov

            version = f"openvino-{ov.__version__.split('-')[0]}"
            return version if self.precision == "f32" else f"{version}-{self.precision}"
        except Exception:  # noqa: BLE001
            return "openvino-unavailable"

    def config(self) -> dict:
        return {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads(),
                "INFERENCE_PRECISION_HINT": self.precision}

    def compile_source(self, source, shapes: dict | None = None):
        """``source``: ONNX model bytes or an ONNX file's path (external data beside it); a
        saved build's file with OpenVINO's own form beside it (``save_native``) is read from
        that instead. ``shapes``: input name -> the static shape it is compiled for (a
        dynamic model at one point; inputs OpenVINO dropped are skipped)."""
        import openvino as ov

        core = ov.Core()
        if isinstance(source, str):
            native = native_path(source)
            model = core.read_model(native if os.path.isfile(native) else source)
        else:
            model = core.read_model(source, b"")
        if shapes:
            names = {n for port in model.inputs for n in port.names}
            model.reshape({n: ov.PartialShape([int(d) for d in s])
                           for n, s in shapes.items() if n in names})
        return core.compile_model(model, "CPU", self.config())

    def save_native(self, onnx_path) -> None:
        """Beside a saved build's ONNX file, the model in OpenVINO's own form (IR: .ov.xml and
        .ov.bin, weights at their precision): a loaded build reads it in a tenth of the time
        its ONNX frontend takes to convert the file (torchvision's r3d_18: 0.007-0.03 s
        against 0.16-0.18 s on the AMX Xeon; the compile after it is the same 0.1 s)."""
        import openvino as ov

        native = native_path(str(onnx_path))
        if not os.path.isfile(native):
            ov.save_model(ov.Core().read_model(str(onnx_path)), native, compress_to_fp16=False)

    def compile(self, model, specs, sole: bool = False, shapes: dict | None = None):
        """``shapes``: compiled for these static input shapes (``compile_source``), each
        output's shape then taken from the compiled model."""
        import openvino as ov

        from collage_tvm.export.onnx import graph_input_names

        with model_source(model) as source:  # a path when over protobuf's 2 GiB
            compiled = self.compile_source(source, shapes)
        if len(compiled.outputs) != len(specs):
            raise RuntimeError(f"openvino: compiled model has {len(compiled.outputs)} outputs, "
                               f"the subgraph {len(specs)}")
        if shapes:
            specs = [(tuple(int(d) for d in port.get_partial_shape().to_shape())
                      if port.get_partial_shape().is_static else None, dtype)
                     for port, (_, dtype) in zip(compiled.outputs, specs)]
        # OpenVINO drops graph inputs the model never reads: bind by name, not position.
        position = {name: i for i, port in enumerate(compiled.inputs) for name in port.names}
        slots = [(k, position[n]) for k, n in enumerate(graph_input_names(model))
                 if n in position]
        request = compiled.create_infer_request()
        set_in, set_out, infer = request.set_input_tensor, request.set_output_tensor, request.infer
        Tensor = ov.Tensor
        if any(shape is None for shape, _ in specs):  # a dynamic model: OpenVINO sizes them
            return _dynamic_call(request, slots, specs, compiled)

        def call(*args):
            for k, i in slots:
                set_in(i, Tensor(as_numpy(args[k]), shared_memory=True))
            outs = []
            for i, (shape, dtype) in enumerate(specs):
                out, view = new_output(shape, dtype)
                set_out(i, Tensor(view, shared_memory=True))
                outs.append(out)
            infer()
            return single_or_tuple(outs)

        def numpy_call(*arrays):  # numpy in, fresh numpy outputs out (no TVM tensors)
            for k, i in slots:
                set_in(i, Tensor(arrays[k], shared_memory=True))
            outs = [np.empty(shape, dtype) for shape, dtype in specs]
            for i, out in enumerate(outs):
                set_out(i, Tensor(out, shared_memory=True))
            infer()
            return outs

        call.compiled = compiled  # keep the compiled model alive with the callable
        if sole:  # the whole model (``artifact.LoadedModule`` calls it with numpy)
            call.numpy_call = numpy_call
        return call


def _dynamic_call(request, slots: list, specs: list, compiled):
    """The callable of a model whose outputs' shapes follow its inputs' (``specs`` with
    None shapes: ``collage_tvm.dynamic``): OpenVINO allocates each output for the shapes
    of the call, which is copied out (the request reuses its memory on the next call)."""
    import openvino as ov

    set_in, infer, get_out = request.set_input_tensor, request.infer, request.get_output_tensor
    Tensor = ov.Tensor
    n = len(specs)

    def numpy_call(*arrays):
        for k, i in slots:
            set_in(i, Tensor(np.ascontiguousarray(arrays[k]), shared_memory=True))
        infer()
        return [np.array(get_out(i).data) for i in range(n)]

    def call(*args):
        outs = []
        for a, (_, dtype) in zip(numpy_call(*(as_numpy(x) for x in args)), specs):
            out, view = new_output(a.shape, dtype)
            view[...] = a
            outs.append(out)
        return single_or_tuple(outs)

    call.compiled = compiled
    call.numpy_call = numpy_call
    return call


class OpenVinoBf16Lowering(OpenVinoLowering):
    """OpenVINO in bf16 (its default on CPUs with bf16 instructions)."""

    name = "openvino_bf16"
    precision = "bf16"
