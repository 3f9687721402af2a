"""Headless Chromium driven over the DevTools protocol (CDP), with no extra package.

Only what the book's browser tests need: open a page in a fresh tab, wait for
its load event, evaluate JavaScript (awaiting promises), record the page's
network requests and script errors, and take a full-page screenshot. The
connection is one websocket to the browser (``websocket-client``, which
Jupyter already installs); each tab is a flattened CDP session on it.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import websocket

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--mute-audio", "--window-size=1280,900",
)
VIEWPORT = {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}


# Process ids of the Chromium instances running now (their process trees outlive
# single tests; tests/browser/conftest.py exempts them from the leftover check).
RUNNING: set[int] = set()


class CDPError(RuntimeError):
    """Chromium did not start, or a DevTools command failed or timed out."""


class Chromium:
    """One headless Chromium process with a fresh profile, and its DevTools socket."""

    def __init__(self, executable: str, start_timeout: float = 60.0):
        self.profile = Path(tempfile.mkdtemp(prefix="ddpguide-chromium-"))
        self.log_path = self.profile.with_name(self.profile.name + ".log")
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )
        RUNNING.add(self.process.pid)
        self._next_id = 0
        self.events: list[dict] = []
        try:
            port, path = self._wait_for_port(start_timeout)
            # No proxy: the socket is on loopback, whatever the environment says.
            self.ws = websocket.create_connection(
                f"ws://127.0.0.1:{port}{path}", timeout=start_timeout, suppress_origin=True,
                http_no_proxy=["127.0.0.1"],
            )
        except BaseException:
            self.close()
            raise

    def _wait_for_port(self, timeout: float) -> tuple[int, str]:
        # Chromium writes the port it chose (and the browser's socket path) here.
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CDPError(f"Chromium exited with code {self.process.returncode}:\n{self.log_tail()}")
            if active.exists():
                lines = active.read_text().split()
                if len(lines) >= 2:
                    return int(lines[0]), lines[1]
            time.sleep(0.05)
        raise CDPError(f"Chromium did not open its DevTools port within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of Chromium's own output (for error messages)."""
        self._log.flush()
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        """Send one command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        reply = self._receive(lambda m: m.get("id") == self._next_id, timeout, method)
        if "error" in reply:
            raise CDPError(f"{method} failed: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, session: str, timeout: float,
                   where: Callable[[dict], bool] = lambda params: True) -> dict:
        """Wait for an event whose params satisfy ``where`` (or find it among
        those already received) and consume it."""
        def match(m: dict) -> bool:
            return (m.get("method") == method and m.get("sessionId") == session
                    and where(m.get("params") or {}))
        for i, event in enumerate(self.events):
            if match(event):
                return self.events.pop(i)
        event = self._receive(match, timeout, method)
        self.events.remove(event)
        return event

    def _receive(self, match, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CDPError(f"no answer to {what} within {timeout:.0f} s")
            self.ws.settimeout(remaining)
            try:
                message = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            if "method" in message:
                self.events.append(message)
            if match(message):
                return message

    def close(self) -> None:
        """End Chromium (politely, then by force) with all its helpers; delete its profile."""
        try:
            helpers = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            helpers = []
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                self.send("Browser.close", timeout=5)
            except Exception:
                pass
            ws.close()
            self.ws = None
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        for helper in helpers:
            try:
                helper.wait(5)
            except psutil.TimeoutExpired:
                helper.kill()
            except psutil.Error:
                pass
        RUNNING.discard(self.process.pid)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


@dataclass
class Request:
    """One network request a page made, and how it ended."""

    url: str
    resource_type: str = ""
    status: int | None = None
    failure: str | None = None


@dataclass
class Tab:
    """A page in its own tab; collects its requests and script errors."""

    browser: Chromium
    target: str = ""
    session: str = ""
    requests: dict[str, Request] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.target = self.browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.browser.send(
            "Target.attachToTarget", {"targetId": self.target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable")
        # Lifecycle events name the navigation they belong to (its loaderId), so a
        # late load event of the tab's first about:blank cannot pass for the page's.
        self.send("Page.setLifecycleEventsEnabled", {"enabled": True})
        self.send("Emulation.setDeviceMetricsOverride", VIEWPORT)

    def send(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def navigate(self, url: str, timeout: float = 60.0) -> None:
        """Open ``url`` and wait for its load event (scripts, styles and images done)."""
        reply = self.send("Page.navigate", {"url": url}, timeout)
        if reply.get("errorText"):
            raise CDPError(f"cannot open {url}: {reply['errorText']}")
        loader = reply.get("loaderId")
        self.browser.wait_event("Page.lifecycleEvent", self.session, timeout,
                                where=lambda p: p.get("name") == "load" and p.get("loaderId") == loader)
        self.collect()

    def evaluate(self, expression: str, timeout: float = 60.0) -> Any:
        """Evaluate JavaScript in the page; promises are awaited; returns the JSON value."""
        reply = self.send("Runtime.evaluate", {
            "expression": expression, "awaitPromise": True, "returnByValue": True,
            "timeout": int(timeout * 1000),
        }, timeout + 5)
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"JavaScript error: {text}")
        self.collect()
        return reply["result"].get("value")

    def collect(self) -> None:
        """Move this tab's received events into ``requests`` and ``errors``."""
        keep = []
        for event in self.browser.events:
            if event.get("sessionId") != self.session:
                keep.append(event)
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                self.requests[params["requestId"]] = Request(params["request"]["url"], params.get("type", ""))
            elif method == "Network.responseReceived" and params["requestId"] in self.requests:
                self.requests[params["requestId"]].status = params["response"]["status"]
            elif method == "Network.loadingFailed" and params["requestId"] in self.requests:
                self.requests[params["requestId"]].failure = params.get("errorText", "failed")
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                self.errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        self.browser.events[:] = keep

    def screenshot(self, path: Path, max_height: int = 20000, quality: int = 80) -> Path:
        """Save a JPEG of the whole page (up to ``max_height`` CSS pixels tall). A page of the
        book is thousands of pixels tall: Chromium encodes it as a JPEG in about two thirds
        of the time a PNG takes.

        The viewport is made as tall as the page first: capturing beyond the
        viewport leaves the theme's sticky sidebar half drawn.
        """
        height = self.evaluate("document.documentElement.scrollHeight")
        height = min(max(int(height), VIEWPORT["height"]), max_height)
        self.send("Emulation.setDeviceMetricsOverride", {**VIEWPORT, "height": height})
        try:
            # Two animation frames: layout and paint at the new size are done.
            self.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
            data = self.send("Page.captureScreenshot", {"format": "jpeg", "quality": quality},
                             timeout=60)["data"]
        finally:
            self.send("Emulation.setDeviceMetricsOverride", VIEWPORT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.browser.send("Target.closeTarget", {"targetId": self.target}, timeout=10)
        except CDPError:
            pass
        self.browser.events[:] = [e for e in self.browser.events if e.get("sessionId") != self.session]
