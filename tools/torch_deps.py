"""Print the requirements of the installed torch that are not met (one per line; nothing when
all are met), evaluating their environment markers and the extras they ask for.

make env installs requirements/lock.txt without dependencies; PyPI's Linux torch (the CUDA
build) then needs the libraries of requirements/torch-cuda.txt, the CPU build needs nothing more:

    .venv/bin/python tools/torch_deps.py
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement


def unmet(name: str, extras: tuple[str, ...] = ("",), seen: set[str] | None = None) -> list[str]:
    """The requirements of distribution `name` (for the given extras) that are not installed at
    a version they accept, and recursively those of the extras they ask for."""
    seen = set() if seen is None else seen
    missing = []
    for line in metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{req} (installed: {version})")
        elif req.extras and req.name not in seen:
            seen.add(req.name)
            missing += unmet(req.name, tuple(sorted(req.extras)), seen)
    return missing


if __name__ == "__main__":
    print("\n".join(unmet(sys.argv[1] if len(sys.argv) > 1 else "torch")))
