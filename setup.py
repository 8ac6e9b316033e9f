from setuptools import find_packages, setup

setup(
    name="collage-tvm",
    version="0.1.0",
    description="Collage (automated integration of deep-learning backends) on TVM Relax",
    python_requires=">=3.10",
    # Every package under collage_tvm/ (tests/test_packaging.py checks the wheel holds every
    # .py file of the tree), the built-in backends included: collage_tvm/backends/<name>/
    # holds a backend's lowering (__init__.py) and its pattern file (patterns.py).
    packages=find_packages(include=["collage_tvm", "collage_tvm.*"]),
    install_requires=[
        "apache-tvm==0.27.0.post1",
        "apache-tvm-ffi==0.1.14.post0",  # 0.1.15.post2 segfaults in MetaSchedule (DESIGN.md)
        "numpy>=1.26,<3",
        "onnx==1.23.2",
        "onnxruntime==1.31.1",
        "torch==2.13.0",  # CPU build; the dnnl backend uses its oneDNN (docs/DNNL_BINDING.md)
        "openvino==2026.4.1",  # the openvino graph backend
        # --accuracy int8's second quantizer (its QDQ placement is OpenVINO's own: on the Zen
        # 4 its int8 file ran 8-42% under OpenVINO's bf16 default, ONNX Runtime's not at all)
        "nncf==3.4.0",
        "mkl==2026.2.0",  # libmkl_rt for the mkl backend (docs/DNNL_BINDING.md, "MKL binding")
        "deap==1.4.4",
        "z3-solver==5.4.0.0",
        "networkx==3.6.1",  # min vertex cuts of the rewrite search's graph split
        "tqdm>=4.66",
        # MetaSchedule (collage-tvm tune): its XGBoost cost model (the CPU-only wheel: the
        # plain xgboost wheel pulls 470 MB of NCCL), its pickling and process helpers.
        "xgboost-cpu==3.2.0",
        "cloudpickle==3.1.2",
        "psutil==7.2.2",
        "tornado==6.6.1",  # TVM's RPC tracker (measuring on other machines: measure.remote)
    ],
    extras_require={
        "plot": ["matplotlib==3.11.2"],  # bench plots, `collage-tvm show` PNG (collage_tvm.tools)
        # transformers: the external model suite (models built from configs, nothing
        # downloaded); pulls no torch of its own beside the pinned CPU build.
        # onnxscript: torch.onnx.export(dynamo=True), the second PyTorch exporter.
        # torchvision 0.28 is the release for torch 2.13 (its C++ detection ops need a CUDA
        # torch and stay unloaded: collage_tvm._torchvision); timm's
        # models are built with pretrained=False.
        "test": ["pytest>=8", "transformers==5.23.0", "onnxscript==0.7.2",
                 "torchvision==0.28.0", "timm==1.0.29", "onnx2torch==1.5.15"],
        # the inductor backend (torch.compile of a subgraph; a GPU graph library): onnx2torch
        # translates the subgraph's ONNX into torch ops; it imports torchvision.
        "gpu": ["onnx2torch==1.5.15"],
    },
    entry_points={
        "console_scripts": ["collage-tvm=collage_tvm.cli:main"],
        # torch.compile(model, backend="collage"): torch._dynamo's backend registry loads
        # this group's entry points by name (docs/deploy_torch_compile.md).
        "torch_dynamo_backends": ["collage = collage_tvm.torch_backend:collage"],
    },
)
