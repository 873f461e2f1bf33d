"""Ctrl-C of `ditserve serve --nproc 2 --device cpu` (a sidecar and a 2-rank replica under torchrun's elastic agent,
gloo on this host): the terminal's SIGINT reaches the launcher's process group; the launcher stops the replica
through its rank 0, whose Stop ends rank 1, so torchrun's agent exits 0 unsignalled, then the sidecar. Every process
exits, and no log holds a traceback or an error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from servicekit import free_port, is_serving, short_tmpdir, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]


def _left(port: int) -> list[str]:
    """The processes of this replica still running (the ranks' argv names the port)."""
    found = subprocess.run(["pgrep", "-f", f"--listen=127.0.0.1:{port}"], capture_output=True, text=True)
    return found.stdout.split()


def test_ctrl_c_stops_a_replica_without_a_traceback(svc_ckpt: Path) -> None:
    run_dir, port = short_tmpdir("dsint-"), free_port()
    argv = [sys.executable, "-m", "ditserve", "serve", "--nproc", "2", "--device", "cpu", "--checkpoint",
            str(svc_ckpt), "--run-dir", str(run_dir), "--port", str(port), "--no-metrics", "--gpu-plans", "64"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a session of its own, as a terminal gives the command it runs: SIGINT to its process group is Ctrl-C
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: is_serving(f"127.0.0.1:{port}"), 300, "the 2-rank replica serving")
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    logs = out.decode(errors="replace") + "".join(p.read_text(errors="replace") for p in run_dir.glob("*.log"))
    assert proc.returncode == 0, logs
    assert "ditserve stopped" in logs and "replica rank 1: stopping" in logs, logs  # rank 0's Stop ended rank 1
    assert "Traceback" not in logs and " ERROR " not in logs, logs
    wait_for(lambda: not _left(port), 10, "no rank left")
