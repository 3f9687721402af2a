"""The package's own temporary folders (``ddpguide.core.scratch``): readable while the process
that made them runs, gone when it exits, never removed by a process forked from it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ddpguide.core import scratch

#: a program run with no folder given: its folder is readable during the run, and printed
RUN_A_PROGRAM = textwrap.dedent("""
    from ddpguide.launch import programs
    done = programs.run("ddp_spawn.py", "--world-size", "0", expect=2, echo=False, launch="typed")
    assert (done.workdir / "ddp_spawn.py").is_file() and done.workdir.name.startswith("ddpguide-program-")
    print(done.workdir)
""")


@pytest.mark.multiprocess
def test_a_program_run_leaves_no_folder_behind_once_the_interpreter_exits(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", RUN_A_PROGRAM], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    workdir = done.stdout.strip()
    assert workdir.startswith(str(tmp_path)) and not os.path.exists(workdir)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ddpguide-")] == []


@pytest.mark.multiprocess
def test_a_forked_process_leaves_its_parent_s_folders_alone():
    folder = scratch.folder("ddpguide-test-")
    try:
        (folder / "kept.txt").write_text("read later by the parent")
        pid = os.fork()
        if pid == 0:  # the child: what its interpreter's exit would do
            scratch._remove_all()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert (folder / "kept.txt").read_text() == "read later by the parent"
        assert folder in scratch.pending()
    finally:
        scratch.remove(folder)
    assert not folder.exists() and folder not in scratch.pending()
