r"""Docstrings written once, for the NumPy layers (:mod:`lnlib.layers`) and the torch modules and
functions (:mod:`lnlib.torch_bridge`): a method's that several classes share (:func:`doc`, as
pandas' ``@doc`` does), the one form of a step's (a ``forward``, a ``backward``: :func:`step`),
and the meaning of each parameter name (:data:`ENTRIES`), from which :func:`parameters` writes
the Parameters section of a signature."""

import inspect
import re

_SECTIONS = ("Returns", "Yields", "Raises", "Attributes", "Notes", "References", "Examples")


def doc(template, *fields):
    """Decorator: give the function the docstring ``template.format(*fields)``."""

    def give(fn):
        fn.__doc__ = template.format(*fields)
        return fn

    return give


STEP = """{0}

Parameters
----------
{1}

Returns
-------
{2}

Raises
------
{3}TypeError, ValueError
    As for {4}.
"""


def step(summary, inputs, outputs, fns, raises=""):
    """Decorator: the docstring of one step of a layer or function (a ``forward``, a
    ``backward``): ``inputs`` and ``outputs`` are its numpydoc entries (one string, entries on
    their own lines), its errors those of ``fns`` (``raises``: entries of more errors before
    them)."""
    return doc(STEP, summary, inputs, outputs, raises, fns)


#: Parameter entries (numpydoc, unindented) by parameter name; ``{default}`` stands for the
#: parameter's default in the signature of the function or class documented.
ENTRIES = {
    "normalized_shape": """normalized_shape : int or tuple of int
    The trailing axes normalized over (D values in all).""",
    "eps": """eps : float, default {default}
    Added to the variance inside the square root.""",
    "elementwise_affine": """elementwise_affine : bool, default {default}
    Whether to learn a weight (the scale :math:`\\gamma`) and, with ``bias``, a bias.""",
    "bias": """bias : bool, default {default}
    With ``elementwise_affine``, whether to learn a bias :math:`\\beta` (zeros).""",
    "weight_offset": """weight_offset : float, default {default}
    Keyword only. The scale is ``weight_offset + weight``, and ``weight`` starts at
    ``1 - weight_offset`` (zeros for the zero-centred gain, ``weight_offset=1.0``), so the
    layer starts as the identity on normalized input whatever the offset.""",
    "residual_dtype": """residual_dtype : dtype or None, default {default}
    Keyword only. The dtype ``h = residual + x`` is stored in (None: that of ``residual``).""",
    "num_groups": """num_groups : int
    G, a divisor of ``num_channels``.""",
    "num_channels": """num_channels : int
    C, the size of axis 1 of ``x``.""",
    "affine": """affine : bool, default {default}
    Whether to learn a per-channel ``weight`` (ones) and ``bias`` (zeros) of shape (C,).""",
    "dtype": """dtype : dtype, default {default}
    Dtype of the parameters.""",
}

#: What RMSNorm (and its fused form) means by the names it shares with LayerNorm.
RMS = {
    "eps": """eps : float, default {default}
    Added to the mean square inside the square root.""",
    "elementwise_affine": """elementwise_affine : bool, default {default}
    Whether to learn a weight (the gain).""",
    "weight_offset": """weight_offset : float, default {default}
    Keyword only. The gain is ``weight_offset + weight``, and ``weight`` starts at
    ``1 - weight_offset``: with 1.0 at zero, as in Gemma's RMSNorm.""",
}


#: What Dynamic Tanh (DyT) means by its parameters.
DYT = {
    "normalized_shape": """normalized_shape : int or 1-tuple of int
    D, the size of the last axis of ``x``.""",
    "elementwise_affine": """elementwise_affine : bool, default {default}
    Whether to learn a weight (ones) and a bias (zeros) of shape (D,).""",
    **{
        name: f"""{name} : float, default {{default}}
    Initial value of the learned scalar ``alpha`` (the DyT paper's default)."""
        for name in ("alpha_init", "alpha_init_value")  # the NumPy layer's, the torch module's
    },
}


def _shown(value):
    """A default as a docstring shows it: ``1e-5``, ``float32``, ``None``."""
    if isinstance(value, float) and 0 < abs(value) < 1e-3:
        return f"{value:g}".replace("e-0", "e-")
    return getattr(value, "__name__", repr(value))


def _own_entries(lines):
    """The entries of a Parameters section, as {name: lines}; a shared entry (``a, b : type``)
    under its first name."""
    found, name = {}, None
    for line in lines:
        if line and not line[0].isspace():
            name = re.split(r"[\s,:]", line, maxsplit=1)[0]
            found[name] = []
        if name is not None:
            found[name].append(line)
    return {name: "\n".join(entry).rstrip() for name, entry in found.items()}


def parameters(table, **more):
    """Decorator: write the Parameters section of a function's or class's docstring, one entry
    per parameter of its signature (of the constructor for a class), in that order.

    An entry the docstring's own Parameters section writes is kept; the others come from
    ``more``, then ``table``, with ``{default}`` the parameter's default. A name documented
    together with the next ones (``a, b : type``) stands for all of them. The section goes
    where the docstring had one, or else before its first later section (Returns, ...).
    Nothing is done under ``python -OO``, which drops docstrings.
    """

    def give(obj):
        if not obj.__doc__:
            return obj
        lines = inspect.cleandoc(obj.__doc__).splitlines()
        heads = [i for i, line in enumerate(lines[:-1]) if set(lines[i + 1]) == {"-"}]
        start = next((i for i in heads if lines[i] == "Parameters"), None)
        after = [i for i in heads if lines[i] in _SECTIONS and (start is None or i > start)]
        end = after[0] if after else len(lines)
        own = _own_entries(lines[start + 2 : end]) if start is not None else {}
        entries, covered = [], set()
        for p in inspect.signature(obj).parameters.values():
            if p.name in covered:
                continue
            entry = own.get(p.name) or more.get(p.name) or table[p.name]
            covered.update(re.split(r"\s*,\s*", entry.split(" : ")[0].splitlines()[0]))
            entries.append(entry.replace("{default}", _shown(p.default)))
        section = ["Parameters", "----------", *entries, ""]
        at = end if start is None else start
        head = lines[:at] if at and not lines[at - 1] else [*lines[:at], ""]
        obj.__doc__ = "\n".join(head + section + lines[end:]).rstrip() + "\n"
        return obj

    return give
