"""Zero-copy exchange of CUDA tensors between torch and CuPy through DLPack, for the torch
bridge (:mod:`lnlib.torch_bridge`).

``to_cupy`` and ``to_torch`` share the device memory (no copy, any strides); DLPack's stream
handshake orders the two libraries' work. Inside ``torch_stream(tensor)`` CuPy launches its
kernels on torch's current stream, so lnlib's kernels queue behind torch's own work with no
synchronisation at all. Imports torch and CuPy only when called.

Derived in the book, chapter "Implementation", section "A torch bridge".
"""

import contextlib


def to_cupy(tensor):
    """A CuPy array on the memory of the CUDA tensor ``tensor`` (same shape, strides, dtype).

    Raises
    ------
    TypeError
        ``tensor`` is not a CUDA tensor.
    """
    import cupy

    if not getattr(tensor, "is_cuda", False):
        raise TypeError(
            f"tensor: expected a CUDA tensor, got {type(tensor).__name__} "
            f"on {getattr(tensor, 'device', 'no device')}"
        )
    return cupy.from_dlpack(tensor.detach())


def to_torch(array):
    """A torch tensor on the memory of the CuPy array ``array`` (no copy)."""
    import torch

    return torch.from_dlpack(array)


@contextlib.contextmanager
def torch_stream(tensor):
    """Within the block, CuPy runs on torch's current stream on the device of ``tensor``."""
    import cupy
    import torch

    with cupy.cuda.Device(tensor.device.index):
        stream = torch.cuda.current_stream(tensor.device)
        with cupy.cuda.ExternalStream(stream.cuda_stream):
            yield
