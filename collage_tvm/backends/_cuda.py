"""What the CUDA lowerings (cudnn, cublas) share: whether torch can reach a GPU here, the
version strings, and the DLPack crossing on the device.

cuDNN and cuBLAS are called through PyTorch's CUDA build (the libraries it links; nothing
else to install): its tensors on the device are TVM's tensors seen through DLPack, without
copies. Both run on CUDA's legacy default stream, which TVM's kernels use too, so the
kernels of one executable run in order without extra synchronisation.

f32 parity: PyTorch lets cuDNN and cuBLAS compute f32 convolutions and GEMMs in TF32 by
default on Ampere and later (10 mantissa bits); a lowering turns that off once
(``torch.backends.cudnn.allow_tf32 = False``, ``torch.backends.cuda.matmul.allow_tf32 =
False``) so that a placement matches TVM's f32 result.
"""
from __future__ import annotations


def torch_cuda() -> tuple[bool, str]:
    """``(True, "")`` when torch is importable and sees a CUDA device, else why not."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - any import failure means "not here"
        return False, f"torch is not importable ({type(err).__name__}: {err})"
    try:
        if torch.version.cuda is None:
            return False, (f"torch {torch.__version__} is a CPU-only build (install a CUDA "
                           "build of torch on a machine with an NVIDIA GPU)")
        if not torch.cuda.is_available():
            return False, (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                           "CUDA device here")
    except Exception as err:  # noqa: BLE001 - available() never raises
        return False, f"{type(err).__name__}: {err}"
    return True, ""


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def f32_parity() -> None:
    """No TF32 in cuDNN convolutions or cuBLAS GEMMs (module doc)."""
    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def device_io(nparams: int, library: str):
    """``(to_torch, from_torch, check)``: DLPack both ways, and a check of the argument count."""
    import torch
    import tvm

    def check(args):
        if len(args) != nparams:
            raise TypeError(f"{library} kernel takes {nparams} tensors, got {len(args)}")

    return torch.from_dlpack, tvm.runtime.from_dlpack, check


def to_device(arr, device="cuda"):
    """A numpy constant as a contiguous float32 tensor on the GPU (``None`` stays None)."""
    import torch

    return None if arr is None else torch.from_numpy(arr.copy()).to(device)
