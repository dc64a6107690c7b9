"""lnlib: Layer Normalization and its relatives, forward and backward, in NumPy (and CuPy).

The package of the lnlib textbook. Every public function has a readable twin in
:mod:`lnlib.reference` that it is tested against, validates its arguments before doing any
work, and never modifies its inputs (except BatchNorm's running statistics, by design).
An ndarray subclass (``numpy.matrix``, ``numpy.memmap``) is used as ``numpy.asarray`` makes it,
a plain ndarray of the same memory, so results are plain ndarrays on every implementation;
masked arrays are refused (``TypeError``), their mask would be ignored.

Importing lnlib needs NumPy only; torch, CuPy and matplotlib are imported where they are used.
"""

from ._backend import show_config, use_implementation
from ._rows import get_num_threads, set_num_threads
from .ada_norm import (
    ada_layer_norm,
    ada_layer_norm_backward,
    ada_layer_norm_forward,
    adaln_modulation,
    adaln_modulation_backward,
    adaln_zero_init,
)
from .add_norm import (
    add_layer_norm,
    add_layer_norm_backward,
    add_layer_norm_forward,
    add_rms_norm,
    add_rms_norm_backward,
    add_rms_norm_forward,
)
from .batch_norm import batch_norm, batch_norm_backward, batch_norm_forward
from .dynamic_tanh import dynamic_tanh, dynamic_tanh_backward
from .gradcheck import check_grad, numerical_grad
from .group_norm import group_norm, group_norm_backward, group_norm_forward
from .layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from .layers import AdaLN, BatchNorm, DynamicTanh, GroupNorm, LayerNorm, RMSNorm
from .rms_norm import rms_norm, rms_norm_backward, rms_norm_forward

__version__ = "0.1.0"

__all__ = [
    "layer_norm",
    "layer_norm_forward",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_forward",
    "rms_norm_backward",
    "add_layer_norm",
    "add_layer_norm_forward",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_forward",
    "add_rms_norm_backward",
    "ada_layer_norm",
    "ada_layer_norm_forward",
    "ada_layer_norm_backward",
    "adaln_modulation",
    "adaln_modulation_backward",
    "adaln_zero_init",
    "batch_norm",
    "batch_norm_forward",
    "batch_norm_backward",
    "group_norm",
    "group_norm_forward",
    "group_norm_backward",
    "dynamic_tanh",
    "dynamic_tanh_backward",
    "LayerNorm",
    "RMSNorm",
    "AdaLN",
    "BatchNorm",
    "GroupNorm",
    "DynamicTanh",
    "numerical_grad",
    "check_grad",
    "use_implementation",
    "show_config",
    "set_num_threads",
    "get_num_threads",
]
