"""Docstrings written once: a method's that several classes share (as pandas' ``@doc`` does), and
the parameter entries that the NumPy layers (:mod:`lnlib.layers`) and the torch modules and
functions (:mod:`lnlib.torch_bridge`) share."""


def doc(template, *fields):
    """Decorator: give the function the docstring ``template.format(*fields)``."""

    def give(fn):
        fn.__doc__ = template.format(*fields)
        return fn

    return give


#: Parameter entries (numpydoc, as they stand in a class or function docstring) that
#: :func:`entries` fills into ``{name}`` fields.
ENTRIES = {
    "normalized_shape": """normalized_shape : int or tuple of int
        The trailing axes normalized over (D values in all).""",
    "eps": """eps : float, default 1e-5
        Added to the variance inside the square root.""",
    "scale_offset": """weight_offset : float, default 0.0
        Keyword only. The scale is ``weight_offset + weight``, and ``weight`` starts at
        ``1 - weight_offset`` (zeros for the zero-centred gain, ``weight_offset=1.0``), so the
        layer starts as the identity on normalized input whatever the offset.""",
    "gain_offset": """weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight``, and ``weight`` starts at
        ``1 - weight_offset``: with 1.0 at zero, as in Gemma's RMSNorm.""",
    "affine": """affine : bool, default True
        Whether to learn a per-channel ``weight`` (ones) and ``bias`` (zeros) of shape (C,).""",
    "dtype": """dtype : dtype, default float32
        Dtype of the parameters.""",
}


def entries(obj):
    """Decorator: fill the ``{name}`` fields of the docstring of ``obj`` from :data:`ENTRIES`
    (none under ``python -OO``, which drops docstrings)."""
    if obj.__doc__:
        obj.__doc__ = obj.__doc__.format_map(ENTRIES)
    return obj
