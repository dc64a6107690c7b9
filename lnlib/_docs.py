r"""Docstrings written once, for the NumPy layers (:mod:`lnlib.layers`) and the torch modules and
functions (:mod:`lnlib.torch_bridge`): a method's that several classes share (:func:`doc`, as
pandas' ``@doc`` does), the one form of a step's (a ``forward``, a ``backward``: :func:`step`),
and the meaning of each parameter name (:data:`ENTRIES`), from which :func:`parameters` writes
the Parameters section of a signature. Below them, what each of the two modules fills in: the
steps of a layer (:func:`layer_forward`, :func:`layer_backward`); the bridge's parameter
tables (:data:`TORCH`, :data:`TORCH_MODULE`), its modules' ``forward`` (:func:`module_forward`)
and its autograd Functions (:func:`autograd_function`)."""

import inspect
import re
import textwrap

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
    "dim": """dim : int
    D, the size of the last axis of ``x``.""",
    "cond_dim": """cond_dim : int
    D_c, the size of the conditioning vector c.""",
    "zero_init": """zero_init : bool, default {default}
    adaLN-Zero (weight and bias zero). Otherwise the weight is drawn from
    N(0, 1/cond_dim) with ``rng``.""",
    "rng": """rng : numpy.random.Generator, optional
    Random generator for the weight when ``zero_init`` is False.""",
    "num_features": """num_features : int
    Number of channels C.""",
    "momentum": """momentum : float, default {default}
    Weight of the batch statistics in the running averages.""",
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


# The steps of the NumPy layers (lnlib.layers): a forward through one lnlib function, a backward
# through its backward that also stores the gradients of the parameters.
_X = "x : ndarray\n    Shape ``{}``, floating."
NO_FORWARD = "RuntimeError\n    No forward has been run.\n"


def layer_forward(fn, shape, result, inputs=_X, outputs="y : ndarray, shape and dtype of ``x``"):
    """Decorator: the docstring of a layer's ``forward`` through the lnlib function ``fn``: by
    default from ``x`` of ``shape`` to ``y``, which is ``result``."""
    return step(f"Compute the layer with :func:`lnlib.{fn}`; save what backward needs.",
                inputs.format(shape),
                f"{outputs}\n    {result}", f":func:`lnlib.{fn}`")  # fmt: skip


def layer_backward(fn, stored, dh="", outputs="dx : ndarray, shape and dtype of ``x``", to=""):
    """Decorator: the docstring of a layer's ``backward`` through the lnlib function ``fn``: by
    default from ``dy`` to ``dx``, with ``dh`` (the entry of a second gradient) after ``dy``."""
    summary = f"Backward of the last :meth:`forward` (:func:`lnlib.{fn}`); also stores {stored}."
    dy = "dy : ndarray, shape of the last forward's ``x``\n    Gradient of the loss with respect "
    dy += "to the last forward's output" + (" ``y``." if dh else ".") + dh
    dx = f"{outputs}\n    Gradient of the loss with respect to the last forward's input{to}."
    return step(summary, dy, dx, f":func:`lnlib.{fn}`", NO_FORWARD)


#: The fused layers' forward takes x and residual and returns y and h (the arguments of
#: :func:`layer_forward` after ``fn``); their backward takes dy and dh and returns the one gradient
#: of x and residual (those of :func:`layer_backward` after ``stored``).
ADD_FORWARD = (
    "(*lead, *normalized_shape)",
    "The normalized ``h`` (dtype of ``x``) and ``h = residual + x`` (``residual_dtype``).",
    "x, residual : ndarray\n    Shape ``{}``, floating; the two dtypes may differ.",
    "y, h : ndarray, shape of ``x``",
)
ADD_BACKWARD = (
    "\ndh : ndarray, shape of ``x``, optional\n    Gradient with respect to ``h``, arriving "
    "along the residual stream (None: zero).",
    "dsum : ndarray, shape and dtype of ``h``",
    "s ``x`` and ``residual`` alike",
)


#: The steps of AdaLN (lnlib.layers.AdaLN), as :func:`step`'s arguments: the LayerNorm of x
#: modulated by the conditioning c, and back to dx and dc.
ADALN_FORWARD = (
    "Modulate the LayerNorm of ``x`` by the conditioning ``c``; return ``(y, gate)``.",
    "x : ndarray, shape ``(B, dim)`` or ``(B, T, dim)``, floating\n    Input, normalized over "
    "its last axis.\nc : ndarray, shape ``(B, cond_dim)``, floating\n    Conditioning vectors.",
    "y : ndarray, shape and dtype of ``x``\n    :math:`\\hat{x}\\,(1 + \\mathrm{scale}) + "
    "\\mathrm{shift}`.\ngate : ndarray, shape ``(B, dim)`` (``(B, 1, dim)`` for 3-d ``x``)\n"
    "    The gate for the residual branch that follows (applied by the caller).",
    ":func:`lnlib.adaln_modulation` and :func:`lnlib.ada_layer_norm_forward`",
)
ADALN_BACKWARD = (
    "Backward of the last :meth:`forward`: ``(dx, dc)``; also stores ``dweight``, ``dbias``.",
    "dy : ndarray, shape of ``x``\n    Gradient of the loss with respect to ``y``.\n"
    "dgate : ndarray, shape of ``gate``, optional\n    Gradient with respect to ``gate``; "
    "None counts as zero.",
    "dx : ndarray, shape and dtype of ``x``\n    Gradient with respect to ``x``.\n"
    "dc : ndarray, shape ``(B, cond_dim)``\n    Gradient with respect to ``c``.",
    ":func:`lnlib.ada_layer_norm_backward` and :func:`lnlib.adaln_modulation_backward`",
    NO_FORWARD,
)


# The torch bridge (lnlib.torch_bridge): what the parameters of its functions and modules mean,
# the docstrings of its modules' forward and extra_repr and of its autograd Functions.
_RESIDUAL_DTYPE = """residual_dtype : torch.dtype or None, default None
    Keyword only. The dtype ``h = residual + x`` is stored in (None: that of ``residual``;
    float32 for a float16 ``x`` keeps the stream in float32)."""
TORCH_RMS_EPS = """eps : float or None, default None
    Added to the mean square inside the square root; None means ``torch.finfo(x.dtype).eps``
    (of the dtype of ``h`` for the fused add), as in PyTorch."""
#: The bridge's functions (``layer_norm``, ...).
TORCH = {
    **ENTRIES,
    "x": """x : torch.Tensor, shape ``(..., *normalized_shape)``, float16/bfloat16/float32/float64
    Input, on the CPU or a CUDA device.""",
    "residual": """residual : torch.Tensor, shape of ``x``, floating
    The residual stream (``x`` is the sublayer's output), on the device of ``x``; the dtypes
    of the two may differ.""",
    "weight": """weight : torch.Tensor of shape ``normalized_shape`` or None, default None
    The scale (gain) :math:`\\gamma`, on the device of ``x``.""",
    "bias": """bias : torch.Tensor of shape ``normalized_shape`` or None, default None
    The bias :math:`\\beta`, on the device of ``x``.""",
    "weight_offset": """weight_offset : float, default {default}
    Keyword only: the scale is ``weight_offset + weight`` (1.0: the zero-centred gain, as in
    Gemma's RMSNorm).""",
    "residual_dtype": _RESIDUAL_DTYPE,
}
#: What GroupNorm and Dynamic Tanh mean by the parameters of their bridge functions.
TORCH_GROUP = {
    **TORCH,
    "x": """x : torch.Tensor, shape ``(N, C, *spatial)``, float16/bfloat16/float32/float64
    Input, on the CPU or a CUDA device.""",
    "num_groups": """num_groups : int
    G, a divisor of C.""",
    "weight": """weight, bias : torch.Tensor of shape (C,) or None
    Per-channel gain and bias, on the device of ``x``.""",
}
TORCH_DYT = {
    **TORCH,
    "x": """x : torch.Tensor, shape ``(..., D)``, floating
    Input, on the CPU or a CUDA device.""",
    "alpha": """alpha : torch.Tensor of shape () or (1,), or float
    The scalar :math:`\\alpha`; a float is a constant (no gradient), applied like
    ``torch.tanh(alpha * x)`` applies it: not rounded to the dtype of ``x`` first.""",
    "weight": """weight, bias : torch.Tensor of shape (D,) or None
    Gain and bias along the last axis, on the device of ``x``.""",
}
GROUP_RETURNED = (
    " and its memory format (channels-last or not, as ``torch.nn.functional.group_norm`` keeps"
    " it, also for the gradient of ``x``)"
)
_FUSED_RETURNS = """y : torch.Tensor
    Shape and dtype of ``x``: the norm of ``h`` as stored.
h : torch.Tensor
    ``residual + x`` in ``residual_dtype``. Both are differentiable (once); ``x`` and
    ``residual`` get one gradient, ``dh + dy`` through the norm, each in its own dtype."""


def _indent(text):
    """``text`` as the description of a numpydoc entry: wrapped, indented by 4."""
    return textwrap.fill(text, 92, initial_indent="    ", subsequent_indent="    ")


def torch_function(lnlib_fn, table=TORCH, returned="", **more):
    """Decorator: the Parameters, Returns and Raises sections of a function of the bridge that
    runs :func:`lnlib.<lnlib_fn>`. Its parameters come from ``more``, then ``table``; it returns
    ``y`` (``returned`` says more of it) differentiable in its tensor inputs, or, with a
    ``residual``, ``y`` and ``h``; its errors are those of its checks of the tensors, then those
    of ``lnlib_fn``."""

    def give(fn):
        if not fn.__doc__:
            return fn
        names = list(inspect.signature(fn).parameters)
        tensors = [f"``{n}``" for n in names if n in ("x", "alpha", "weight", "bias")]
        tensors = [t + " (a tensor)" if "alpha" in t else t for t in tensors]
        inputs = f"{', '.join(tensors[:-1])} and {tensors[-1]}"
        returns = f"Shape and dtype of ``x``{returned}; differentiable (once) in {inputs}."
        returns = f"torch.Tensor\n{_indent(returns)}"
        checks = ["``x`` is not a floating tensor"]
        if "residual" in names:
            returns, checks = _FUSED_RETURNS, ["``x`` or ``residual`` is not a floating tensor"]
        if "normalized_shape" in names:
            checks.append("``x`` does not end with ``normalized_shape``")
        if "residual_dtype" in names:
            checks.append("``residual_dtype`` is not a floating dtype")
        checks = " or ".join([", ".join(checks[:-1]), checks[-1]] if checks[1:] else checks)
        raises = _indent(f"{checks}; otherwise as :func:`lnlib.{lnlib_fn}`.")
        raises = f"TypeError, ValueError\n{raises}"
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__)}\n\nReturns\n-------\n{returns}\n\n"
        fn.__doc__ += f"Raises\n------\n{raises}\n"
        return parameters(table, **more)(fn)

    return give


#: The bridge's modules' constructors (``LayerNorm``, ...).
TORCH_MODULE = {
    **ENTRIES,
    "device": """device : torch.device or None, default None
    Device of the parameters (None: torch's default).""",
    "dtype": """dtype : torch.dtype or None, default None
    Dtype of the parameters (None: torch's default).""",
    "residual_dtype": _RESIDUAL_DTYPE,
}

_MODULE_STEPS = {  # a module's forward: what it computes, from what, to what
    False: ("the layer", "x : torch.Tensor\n    Input, floating, on the device of the "
            "parameters (CPU or CUDA).", "torch.Tensor\n    Shape and dtype of ``x``"),
    True: ("``h = residual + x`` and the layer on ``h``", "x, residual : torch.Tensor\n    The "
           "sublayer's output and the residual stream, one shape, on the parameters' device.",
           "y, h : torch.Tensor\n    The normalized ``h`` (dtype of ``x``) and ``h`` itself"),
}  # fmt: skip


def module_forward(fn, fused=False):
    """Decorator: the docstring of a torch module's ``forward`` through ``fn``: from ``x`` to
    ``y``, or (``fused``) from ``x`` and ``residual`` to ``y`` and ``h``."""
    what, x, y = _MODULE_STEPS[fused]
    return step(f"Compute {what} with :func:`{fn}`.", x, f"{y}; differentiable (once).",
                f":func:`{fn}`")  # fmt: skip


#: A torch module's ``reset_parameters``.
RESET = """Reset the parameters to their initial values, as ``torch.nn`` layers do.

        The weight becomes ``1 - weight_offset`` (ones by default), a bias zeros; in place.

        Returns
        -------
        None
            The parameters are changed in place.
        """

#: A torch module's ``extra_repr``; ``{0}``: whose ``repr`` it follows.
EXTRA_REPR = r"""The constructor arguments shown by ``repr(module)``, as in {0}.

        Returns
        -------
        str
            E.g. the normalized shape, ``eps`` and whether parameters are learned.
        """

_CTX = """ctx : torch.autograd.function.FunctionCtx
    Torch's context object, where the forward saves what the backward needs."""


def autograd_function(cls, forward, name, lnlib_forward, results):
    """Write the docstrings of the autograd Function ``cls`` of the bridge's function ``name``
    (its class note kept after what its ``apply`` returns and which lnlib functions it runs)
    and of its ``forward``, which runs ``lnlib_forward`` and returns ``results``."""
    inputs = ", ".join(map(str, list(inspect.signature(forward).parameters.values())[1:]))
    fn = f":func:`lnlib.{lnlib_forward}`"
    args = f"{_CTX}\n{inputs}\n    The arguments of ``apply``, as the class describes them."
    out = f"{results} : torch.Tensor\n    The results of ``apply``, as the class describes them."
    forward.__doc__ = STEP.format(
        f"Run {fn} on the tensors' memory; save what the backward needs.", args, out, "", fn
    )
    if cls.__doc__:  # None under python -OO
        shown = f"({results})" if "," in results else results
        axes = " over the last ``normalized_ndim`` axes" * ("normalized_ndim" in inputs)
        text = f"``apply({inputs.replace(', *weight_offset', '[, weight_offset]')})`` returns "
        text += f"``{shown}`` of {fn}{axes}; its backward is "
        text += f":func:`lnlib.{name}_backward`. {inspect.cleandoc(cls.__doc__)}"
        # "Covered in" on one line, as the gate of the book's cross-references reads it
        text = text.replace("Covered in", "Covered\xa0in")
        text = textwrap.fill(text, 96, break_on_hyphens=False).replace("\xa0", " ")
        summary = f"The autograd function of :func:`{name}`, its forward and backward lnlib's."
        cls.__doc__ = f"{summary}\n\n{text}"
