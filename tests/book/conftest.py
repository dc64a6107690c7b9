"""Fixtures of the book tests. They check the built site, so `make book` must run first
(`make test` does: the book build comes before these tests)."""

from __future__ import annotations

import functools
import http.server
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from cdp import CHROMIUM_OFFLINE_FLAGS, chromium_binary

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"


@pytest.fixture(scope="session")
def html_dir() -> Path:
    if not (HTML / "index.html").exists():
        pytest.fail("_build/html is missing: run `make book` (or `make test`) first")
    return HTML


@pytest.fixture(scope="session")
def site_url(html_dir):
    """Serve the built book on a loopback port for the browser."""
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def run_chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with every address but 127.0.0.1 unreachable."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        cmd = [chromium_binary(), *CHROMIUM_OFFLINE_FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def chromium():
    return run_chromium
