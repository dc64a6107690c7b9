"""lnlib on the GPU: fused CUDA kernels through CuPy (``kernels``), the row-matrix
implementations the selection point plugs in (``rows``) and the zero-copy DLPack bridge to
torch CUDA tensors (``dlpack``). Nothing here is imported by ``import lnlib``.
"""
