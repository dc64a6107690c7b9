"""One docstring for a method that several classes share (as pandas' ``@doc`` does)."""


def doc(template, *fields):
    """Decorator: give the function the docstring ``template.format(*fields)``."""

    def give(fn):
        fn.__doc__ = template.format(*fields)
        return fn

    return give
