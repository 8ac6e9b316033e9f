"""Write Relax subgraphs in the formats other runtimes read.

The graph-library backends (onnxruntime, openvino) run a chosen subgraph by handing it to
their library as an ONNX model: ``collage_tvm.export.onnx`` is that exporter. The pattern
rules of those backends ask it, node by node, whether an operator can be written at all
(``unsupported_reason``), so only exportable groups become candidates.

Its layers, earliest first: ``base`` (the error, dtypes, reading Relax types), ``builder``
(ONNX nodes and initializers), the converters of each kind (``ops_elementwise``,
``ops_quantize``, ``ops_nn``, ``ops_shape``, ``ops_reduce``) gathered into one table by
``ops``, ``model`` (a written model handed to a library), and on top the writer ``onnx``,
which re-exports every name callers use.
"""
from .onnx import (ExportError, export_function, input_names, model_source, output_names,
                   serialized, unsupported_reason)

__all__ = ["ExportError", "export_function", "input_names", "model_source", "output_names",
           "serialized", "unsupported_reason"]
