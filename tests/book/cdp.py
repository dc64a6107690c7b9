"""A small client of the Chrome DevTools Protocol: one headless Chromium, one tab, driven over
a websocket (websocket-client), so that the book tests can set a phone's viewport, tap a button
and read the console without a browser-automation package.

The browser is offline but for 127.0.0.1 (``CHROMIUM_OFFLINE_FLAGS``, which
``conftest.run_chromium`` uses too).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import websocket

CHROMIUM_OFFLINE_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--disable-extensions",
    # No network: names other than 127.0.0.1 do not resolve, and whatever
    # would still go out is sent to a closed local port instead.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",
    "--proxy-bypass-list=127.0.0.1",
)


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("Chromium is not installed: `apt-get install chromium` (.ci/run does this)")


class CDPError(RuntimeError):
    """The browser answered a command with an error, or did not answer in time."""


class Browser:
    """A headless Chromium with one page, attached with a flat session."""

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        self._proc = subprocess.Popen(
            [
                chromium_binary(),
                *CHROMIUM_OFFLINE_FLAGS,
                f"--user-data-dir={self._profile.name}",
                "--remote-debugging-port=0",
                "--hide-scrollbars",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and len(port_file.read_text().split()) == 2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise CDPError("Chromium did not open its DevTools port")
            time.sleep(0.05)
        port, path = port_file.read_text().split()
        self._ws = websocket.create_connection(
            f"ws://127.0.0.1:{port}{path}", timeout=timeout, suppress_origin=True
        )
        self._next_id = 0
        self.events: list[dict] = []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.page(f"{domain}.enable")
        self.page("Page.setLifecycleEventsEnabled", enabled=True)

    def send(self, method: str, session: str | None = None, **params):
        """Send one command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self._ws.send(json.dumps(message))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = json.loads(self._ws.recv())
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)
        raise CDPError(f"{method}: no answer in {self.timeout} s")

    def page(self, method: str, **params):
        return self.send(method, session=self.session, **params)

    def evaluate(self, expression: str):
        """Evaluate JavaScript in the page (promises are awaited) and return its value."""
        result = self.page(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"JavaScript error: {text}")
        return result["result"].get("value")

    def wait_for_event(self, method: str, seconds: float = 30.0) -> dict:
        """Wait for an event of the page (one already received counts)."""
        deadline = time.monotonic() + seconds
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method and event.get("sessionId") == self.session:
                    return self.events.pop(i)
            if time.monotonic() > deadline:
                raise CDPError(f"no {method} in {seconds} s")
            self._ws.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                event = json.loads(self._ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            finally:
                self._ws.settimeout(self.timeout)
            if "method" in event:
                self.events.append(event)

    def set_viewport(self, width: int, height: int, mobile: bool) -> None:
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=mobile,
        )
        self.page("Emulation.setTouchEmulationEnabled", enabled=mobile, maxTouchPoints=1)

    def open(self, url: str, seconds: float = 60.0) -> None:
        """Load a page and wait until the document of this navigation has loaded."""
        loader = self.page("Page.navigate", url=url).get("loaderId")
        deadline = time.monotonic() + seconds
        while True:
            left = max(0.1, deadline - time.monotonic())
            event = self.wait_for_event("Page.lifecycleEvent", left)
            params = event["params"]
            if params.get("name") == "load" and params.get("loaderId") == loader:
                return

    def tap(self, x: float, y: float) -> None:
        """A finger's tap at viewport coordinates (touch start and end)."""
        point = [{"x": x, "y": y, "radiusX": 1, "radiusY": 1, "force": 1, "id": 0}]
        self.page("Input.dispatchTouchEvent", type="touchStart", touchPoints=point)
        self.page("Input.dispatchTouchEvent", type="touchEnd", touchPoints=[])

    def click(self, x: float, y: float) -> None:
        """A mouse click at viewport coordinates."""
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def console_errors(self) -> list[str]:
        """Errors the page reported since the last call: uncaught exceptions, console.error,
        and the browser's own error log (failed loads, blocked requests)."""
        errors, kept = [], []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                place = f"{details.get('url', '')}:{details.get('lineNumber')}"
                errors.append(f"uncaught: {text} ({place})")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = [a.get("value", a.get("description", "")) for a in params.get("args", [])]
                errors.append("console.error: " + " ".join(map(str, args)))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
            else:
                kept.append(event)
                continue
        self.events = [e for e in kept if e.get("method") not in _CONSOLE_EVENTS]
        return errors

    def screenshot(self, path: Path) -> None:
        data = self.page("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if getattr(self, "_ws", None):
                self._ws.close()
        finally:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._profile.cleanup()


_CONSOLE_EVENTS = ("Runtime.consoleAPICalled", "Log.entryAdded", "Runtime.exceptionThrown")
