"""lnlib on the GPU, through CuPy: the CUDA source (``norms.cuh``, ``norms.cu``), its compiler
(:mod:`lnlib._cuda.build`: NVRTC through CuPy, at first use), the row implementations the
selection point plugs in (:mod:`lnlib._cuda.cuda_kernel`) and the zero-copy DLPack bridge to torch
(:mod:`lnlib._cuda.dlpack`)."""
