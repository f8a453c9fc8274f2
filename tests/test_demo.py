"""The demo (``scripts/vllm-cpu/demo.py``, what ``scripts/demo`` runs) leaves nothing running when it is stopped.

Started as a shell's background job (``scripts/demo &``) it inherits SIGINT ignored; it once left vLLM running
then. Here it is stopped while vLLM boots, which is when it is most often given up on, and what it started must
be gone: its vLLM (API server, engine core, workers) and everything else it spawned.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lab

pytestmark = pytest.mark.realvllm
DEMO = Path(lab.__file__).with_name("demo.py")


def _pids_with(text: str) -> set[int]:
    """The processes whose command line holds ``text``."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.add(int(proc.name))
            except OSError:
                continue
    return found


def _group(pgid: int) -> set[int]:
    """The live processes of process group ``pgid`` (a zombie has done its work: not counted)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.add(int(proc.name))
    return found


@pytest.mark.parametrize("reader", ["reading", "gone"])
def test_ctrl_c_stops_everything_the_demo_started(reader: str) -> None:
    """SIGINT, with SIGINT ignored as a background job inherits it (SIGTERM and SIGHUP take the same handler). With
    the reader of its output gone (``scripts/demo | tee demo.log``: Ctrl-C kills tee too), its next print raised
    BrokenPipeError and vLLM stayed, with 2 GB and its port."""
    lab.install()
    port = lab.free_port()
    marker = f"--port {port}"  # on the command line of vLLM's API server
    env = {**os.environ, "VLLM_PORT": str(port), "AGENT_PORT": str(lab.free_port())}
    demo = shlex.join([sys.executable, "-u", str(DEMO)])
    proc = subprocess.Popen(
        ["sh", "-c", f'trap "" INT; exec {demo}'],  # as `&` starts it: SIGINT ignored
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    vllm_group = None
    try:
        deadline = time.monotonic() + 60
        while not _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        (api_server,) = _pids_with(marker) or [None]
        assert api_server, "the demo never started vLLM"
        vllm_group = os.getpgid(api_server)  # vLLM runs in a session of its own: its engine core and workers too
        deadline = time.monotonic() + 60
        while len(_group(vllm_group)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_group(vllm_group)) >= 2, "vLLM's API server never started its engine core"
        if reader == "gone":
            assert proc.stdout is not None
            proc.stdout.close()  # as tee, killed by the same Ctrl-C: the demo's prints now go to a closed pipe
        out, _ = lab.stop_process(proc, signal.SIGINT, timeout=60)
        spawned = _group(proc.pid)  # the demo leads its own group: the agent and the load it started are in it
    finally:
        # whatever happened, nothing of this test outlives it: the demo's own group (its agent, its load) and vLLM's
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = _group(vllm_group) if vllm_group else set()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert reader == "gone" or "stopping..." in (out or ""), out
    assert not left, f"the demo left vLLM's processes {sorted(left)} running"
    assert not spawned, f"the demo left its processes {sorted(spawned)} running"
