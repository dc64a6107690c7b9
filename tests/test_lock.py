"""The lock installs from the public package registry alone (as on a reader's machine or a hosted
runner): pip in isolated mode (no local wheel folder, no local index, no constraint file) resolves
all of requirements/lock.txt with requirements/torch-cuda.txt, dependencies included, and every
file it picks matches a hash of the lock. Needs the network (PyPI); it downloads the wheels it
has no metadata for (about 3 GB, into a temporary folder)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
sys.path.insert(0, str(ROOT / "tools"))

from torch_deps import unmet  # noqa: E402 - tools/ is put on sys.path just above


def isolated_dry_run(tmp_path, *args):
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "--isolated",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--require-hashes",
        "--quiet",
        "--report",
        str(report),
        "--index-url",
        "https://pypi.org/simple",
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    return {item["metadata"]["name"]: item for item in json.loads(report.read_text())["install"]}


def pins(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+?)\s", path.read_text(), re.M))


@pytest.mark.network
def test_the_whole_lock_resolves_from_the_public_registry(tmp_path):
    chosen = isolated_dry_run(
        tmp_path, "-r", str(REQ / "lock.txt"), "-r", str(REQ / "torch-cuda.txt")
    )
    assert chosen["torch"]["metadata"]["version"] == pins(REQ / "lock.txt")["torch"]
    assert chosen["torch"]["download_info"]["url"].startswith("https://files.pythonhosted.org/")
    # with the CUDA build's libraries the set is complete: nothing outside the two files
    locked = {re.sub(r"[-_.]+", "-", n).lower() for n in pins(REQ / "lock.txt")}
    locked |= {re.sub(r"[-_.]+", "-", n).lower() for n in pins(REQ / "torch-cuda.txt")}
    assert {re.sub(r"[-_.]+", "-", n).lower() for n in chosen} <= locked


@pytest.mark.network
def test_the_no_deps_packages_come_from_the_public_registry(tmp_path):
    chosen = isolated_dry_run(tmp_path, "--no-deps", "-r", str(REQ / "no-deps.txt"))
    assert set(chosen) == {re.sub(r"_", "-", n) for n in pins(REQ / "no-deps.txt")}


def test_the_torch_pin_has_no_local_label():
    # `torch==X+cpu` is a local build that the public registry does not serve; `torch==X` also
    # matches it where a machine has it
    assert "+" not in pins(REQ / "lock.txt")["torch"]


def test_the_cpu_build_is_the_release_the_lock_pins():
    local = pins(REQ / "torch-cpu.txt")["torch"]
    assert local.split("+")[0] == pins(REQ / "lock.txt")["torch"] and "+" in local


def _fake_distribution(site: Path, name: str, version: str, requires: list[str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_torch_deps_lists_only_what_is_missing_for_this_platform(tmp_path, monkeypatch):
    _fake_distribution(
        tmp_path,
        "fakebuild",
        "1.0",
        [
            "packaging",  # installed
            "fakelib-one==2.0",  # missing
            'fakelib-win==1.0; platform_system == "Nowhere"',  # not for this platform
            "fakekit[part]==3.0",  # installed, its extra needs more
            "fakeold>=2",  # installed at 1.0: too old
        ],
    )
    _fake_distribution(tmp_path, "fakekit", "3.0", ['fakepart==1.0; extra == "part"'])
    _fake_distribution(tmp_path, "fakeold", "1.0", [])
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = unmet("fakebuild")
    assert missing == [
        "fakelib-one==2.0",
        'fakepart==1.0; extra == "part"',
        "fakeold>=2 (installed: 1.0)",
    ]
