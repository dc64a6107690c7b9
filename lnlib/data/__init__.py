"""Data that ships inside lnlib, so that the book's notebooks need nothing but the package.

Covered in the book, chapter "Implementation", section "Performance".
"""

from __future__ import annotations

import json
from importlib import resources

__all__ = ["load_benchmark"]

BENCHMARKS = ("cpu_layer_norm", "cpu_fused_add")


def load_benchmark(name: str = "cpu_layer_norm") -> dict:
    r"""Load the committed results of one of lnlib's benchmarks.

    ``cpu_layer_norm`` is the output of ``python -m lnlib.bench --steps ... --out
    lnlib/data/cpu_layer_norm.json`` (its ``"command"`` entry has the whole command): the
    machine it ran on, the memory-copy bandwidth, lnlib's LayerNorm and RMSNorm against
    PyTorch's, with and without ``out=``, and the time of each optimisation step, as written
    by ``lnlib.bench``. ``cpu_fused_add`` is the output of ``python -m lnlib.bench --ops
    add_layer_norm,add_rms_norm ... --out lnlib/data/cpu_fused_add.json``: the fused residual
    add (``lnlib.add_layer_norm``, ``lnlib.add_rms_norm``) against lnlib's add then norm and
    against PyTorch's ``residual + x`` then the norm, in its ``"fused"`` entry.

    Parameters
    ----------
    name : str, optional
        Which benchmark; one of ``BENCHMARKS`` (default ``"cpu_layer_norm"``).

    Returns
    -------
    dict
        The parsed JSON document; its ``"command"`` entry is the command that wrote it.

    Raises
    ------
    ValueError
        If `name` is not one of ``BENCHMARKS``.

    Notes
    -----
    Covered in the book, chapter "Implementation", section "Performance".
    """
    if name not in BENCHMARKS:
        raise ValueError(f"name must be one of {BENCHMARKS}, got {name!r}")
    text = resources.files(__package__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)
