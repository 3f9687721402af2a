"""The chapters run in JupyterLab as a reader runs them.

These tests start JupyterLab exactly as ``make lab`` does (``tools/lab.py``),
open a notebook session through its REST API and execute code over the
kernel's websocket, as the JupyterLab front end does. They check what differs
from nbmake, which runs each chapter in ``make test``: the kernel the server
picks is this environment's Python, it starts in ``book/``, it imports
``ddpguide``, ``spawn`` works from it (ranks start, their prints reach the
cell, none is left behind), and the JupyterLab widget manager is installed so
that widgets are live.

Executing every chapter this way would run each chapter a second time in
``make test``, for little more than nbmake already checks (the same kernel
spec, the same working directory), so it is opt-in: ``make test-lab`` (or
``DDPGUIDE_LAB_CHAPTERS=1``) executes every notebook in ``_toc.yml`` cell by
cell through JupyterLab.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import nbformat
import psutil
import pytest
import websocket
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
sys.path.insert(0, str(ROOT / "tools"))
from lab import lab_command  # noqa: E402
from mirror_book import toc_files  # noqa: E402

FULL_RUN = os.environ.get("DDPGUIDE_LAB_CHAPTERS", "") not in ("", "0")
START_TIMEOUT_S = 120.0


@dataclass
class Reply:
    """What one executed cell produced."""

    status: str
    stdout: str = ""
    error: str = ""
    data: list[dict] = field(default_factory=list)
    comm_opens: list[dict] = field(default_factory=list)


class LabServer:
    """A running JupyterLab, reached over HTTP with its token."""

    def __init__(self, process: subprocess.Popen, info: dict, log: Path):
        self.process, self.log = process, log
        self.base = f"http://127.0.0.1:{info['port']}{info['base_url']}"
        self.token = info["token"]
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, body: dict | None = None) -> object:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"token {self.token}", "Content-Type": "application/json"})
        with self.opener.open(req, timeout=60) as response:
            text = response.read().decode()
        return json.loads(text) if text.strip().startswith(("{", "[")) else text


class Kernel:
    """A notebook session's kernel, driven over its websocket like the front end does."""

    def __init__(self, lab: LabServer, notebook_path: str):
        self.lab = lab
        session = lab.request("POST", "api/sessions", {
            "path": notebook_path, "name": Path(notebook_path).name, "type": "notebook",
            "kernel": {"name": "python3"}})
        self.session_id, self.kernel_id = session["id"], session["kernel"]["id"]
        self.client_session = uuid.uuid4().hex
        url = (lab.base.replace("http://", "ws://") + f"api/kernels/{self.kernel_id}/channels"
               f"?session_id={self.client_session}&token={lab.token}")
        self.ws = websocket.create_connection(url, timeout=START_TIMEOUT_S, http_no_proxy=["127.0.0.1"])
        self.process: psutil.Process | None = None
        pid = int(self.execute("import os; print(os.getpid())", 120).stdout.strip())
        # Held from now on: a Process object knows its start time, so it never
        # mistakes a later process that is given the same pid for the kernel.
        self.process = psutil.Process(pid)

    def execute(self, code: str, timeout: float) -> Reply:
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                       "session": self.client_session, "version": "5.3",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        }))
        reply, idle = Reply("unknown"), False
        replied = False
        deadline = time.monotonic() + timeout
        while not (idle and replied):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no reply within {timeout:.0f} s to:\n{code[:500]}")
            self.ws.settimeout(remaining)
            message = json.loads(self.ws.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                reply.stdout += content["text"]
            elif kind in ("display_data", "execute_result"):
                reply.data.append(content["data"])
            elif kind == "comm_open":
                reply.comm_opens.append(content)
            elif kind == "error":
                reply.error = "\n".join(content.get("traceback") or [content.get("evalue", "")])
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
            elif kind == "execute_reply":
                reply.status, replied = content["status"], True
        return reply

    def close(self) -> None:
        self.ws.close()
        self.lab.request("DELETE", f"api/sessions/{self.session_id}")
        if self.process is not None:
            _wait_gone(self.process, 20)


def _wait_gone(process: psutil.Process, timeout: float) -> None:
    """Wait for a process to end; kill it if it is still there, and say so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"process {process.pid} was still running {timeout:.0f} s after shutdown")


def _server_info(path: Path) -> dict | None:
    """The server's connection file, or None while it is still being written.

    Jupyter writes it in place (truncate, then dump), so a read can see it empty or cut short.
    """
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, FileNotFoundError):
        return None
    return info if isinstance(info, dict) and "port" in info else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    runtime = tmp_path_factory.mktemp("jupyter-runtime")
    log = runtime / "lab.log"
    token = secrets.token_hex(16)
    command = lab_command(["--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
                           f"--IdentityProvider.token={token}"])
    # the kernel runs programs as typed, as a reader's JupyterLab does (the tests' fast path is
    # this process's own setting, not inherited)
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        info = None
        while info is None:
            assert process.poll() is None, f"JupyterLab exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"JupyterLab did not start:\n{log.read_text()[-3000:]}"
            for path in runtime.glob("jpserver-*.json"):
                info = _server_info(path)
            time.sleep(0.2)
        yield LabServer(process, info, log)
    finally:
        process.terminate()  # JupyterLab shuts its kernels down on SIGTERM
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture
def kernel(lab: LabServer) -> Iterator[Kernel]:
    k = Kernel(lab, "lab_probe.ipynb")  # the file need not exist: the kernel starts in book/
    try:
        yield k
    finally:
        k.close()


def test_make_lab_serves_book_and_allows_root():
    command = lab_command()
    assert f"--notebook-dir={BOOK}" in command
    assert ("--allow-root" in command) == (os.geteuid() == 0)


@pytest.mark.timeout(300)
def test_kernel_is_this_environment_in_book_with_the_package(kernel: Kernel):
    reply = kernel.execute(
        "import json, os, sys, ddpguide\n"
        "print(json.dumps({'cwd': os.getcwd(), 'prefix': sys.prefix, 'package': ddpguide.__file__}))",
        120)
    assert reply.status == "ok", reply.error
    seen = json.loads(reply.stdout)
    assert Path(seen["cwd"]) == BOOK
    assert Path(seen["prefix"]).resolve() == Path(sys.prefix).resolve(), "the python3 kernel is another Python"
    assert Path(seen["package"]).resolve().is_relative_to(ROOT), seen["package"]


@pytest.mark.timeout(300)
def test_spawn_from_a_lab_kernel_echoes_ranks_and_leaves_no_child(kernel: Kernel):
    reply = kernel.execute(
        "import multiprocessing\n"
        "from ddpguide.launch.spawn import spawn\n"
        "from ddpguide.core.ranklog import rank_print\n"
        "results = spawn(rank_print, 2, 'hello from a JupyterLab kernel', kwargs={'all_ranks': True}, timeout=120)\n"
        "print('results', results)\n"
        "print('children', len(multiprocessing.active_children()))\n",
        200)
    assert reply.status == "ok", reply.error
    assert "[rank 0] hello from a JupyterLab kernel" in reply.stdout, reply.stdout
    assert "[rank 1] hello from a JupyterLab kernel" in reply.stdout, reply.stdout
    assert "results [None, None]" in reply.stdout and "children 0" in reply.stdout, reply.stdout


@pytest.mark.timeout(300)
def test_widgets_are_live_in_lab(lab: LabServer, kernel: Kernel):
    page = lab.request("GET", "lab")
    assert isinstance(page, str) and "@jupyter-widgets/jupyterlab-manager" in page, (
        "the JupyterLab widget manager (jupyterlab_widgets) is not installed")
    reply = kernel.execute("import ipywidgets\n"
                           "ipywidgets.IntSlider(value=3, description='ranks')", 120)
    assert reply.status == "ok", reply.error
    views = [d["application/vnd.jupyter.widget-view+json"] for d in reply.data
             if "application/vnd.jupyter.widget-view+json" in d]
    assert len(views) == 1
    models = {c["comm_id"]: c["data"]["state"] for c in reply.comm_opens
              if c.get("target_name") == "jupyter.widget"}
    assert models[views[0]["model_id"]]["value"] == 3


def chapter_notebooks() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    found = []
    for entry in toc_files(toc):
        path = ROOT / (entry if entry.endswith(".ipynb") else entry + ".ipynb")
        if path.exists():
            found.append(path.relative_to(BOOK).as_posix())
    return found


@pytest.mark.skipif(not FULL_RUN, reason="every chapter through JupyterLab: `make test-lab` "
                    "(make test already executes each chapter once with nbmake)")
@pytest.mark.parametrize("notebook", chapter_notebooks())
@pytest.mark.timeout(900)
def test_chapter_runs_in_lab(lab: LabServer, notebook: str):
    nb = nbformat.read(BOOK / notebook, as_version=4)
    timeout = float((nb.metadata.get("execution") or {}).get("timeout") or 600)
    k = Kernel(lab, notebook)
    try:
        for index, cell in enumerate(nb.cells):
            tags = set(cell.metadata.get("tags", []))
            if cell.cell_type != "code" or "skip-execution" in tags:
                continue
            reply = k.execute(cell.source, timeout)
            if "raises-exception" not in tags:
                assert reply.status == "ok", f"{notebook}, cell {index}:\n{reply.error}"
    finally:
        k.close()
