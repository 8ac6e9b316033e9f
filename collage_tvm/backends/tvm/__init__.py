"""The tvm backend (TVM's own codegen): only its pattern file, ``patterns.py``, lives here;
it registers no lowering (``lowering=None``): what stays on TVM is built by TVM itself."""
