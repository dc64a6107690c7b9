"""Checks for the book's exercises.

A chapter's exercise asks the reader to write a function; the chapter's checker
(for example :func:`lnlib.exercises.intro.check_standardize`) runs it against a
reference on ordinary and edge-case inputs with :func:`check`, and prints either
that every case passes or which case fails and how (expected versus got).

Example
-------
>>> import numpy as np
>>> from lnlib.exercises import Case, check
>>> cases = [Case("a small vector", (np.array([1.0, 2.0, 3.0]),))]
>>> result = check(lambda x: x * 2, lambda x: x + x, cases, name="double")
PASS double: all 1 cases pass.
>>> bool(result)
True

:func:`glue` records a value for the book's prose (MyST-NB's ``glue`` where it is
installed, a plain display elsewhere, so notebooks also run in Colab).

Chapter modules (``intro``, ``ch01``, ``ch02``, ``ch03``, ``ch05``, ``ch06``) hold the checkers of
each chapter and are imported on their own: ``from lnlib.exercises import intro``.
"""

from ._core import Case, CheckResult, Failure, check, glue

__all__ = ["Case", "CheckResult", "Failure", "check", "glue"]
