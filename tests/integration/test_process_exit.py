"""How a `fedtrain` process ends: once its command returned, with no thread of its own left to
wait for, it ends at once (`fedtrain.cli.commands.run`), without the interpreter's teardown of
torch's modules (seconds of a loaded machine's CPU for every coordinator, participant and rank
that stops). Seen from outside through PYTHONVERBOSE, under which a teardown prints its
`# cleanup` lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers.api import download
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator

TORN_DOWN = "# cleanup["  # what PYTHONVERBOSE prints as the interpreter tears its modules down


def test_a_daemon_thread_left_running_does_not_hold_the_exit(tmp_path: Path) -> None:
    """A daemon thread (a participant's event listener) is never waited for at exit: the exit
    stays the fast one. The exit handlers still run."""
    code = (
        "import atexit, threading, time\n"
        "import fedtrain.cli.commands as commands\n"
        "atexit.register(print, 'exit handlers ran', flush=True)\n"
        "threading.Thread(target=time.sleep, args=(60,), name='listener', daemon=True).start()\n"
        "commands.main = lambda: 3\n"
        "commands.run()\n"
    )
    r = subprocess.run([sys.executable, "-v", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "exit handlers ran" in r.stdout
    assert TORN_DOWN not in r.stderr, "the process tore its modules down: the daemon thread held the fast exit"


def test_a_thread_left_running_is_waited_for(tmp_path: Path) -> None:
    """A non-daemon thread still working is waited for (the normal exit): what it does last is done."""
    code = (
        "import threading, time\n"
        "import fedtrain.cli.commands as commands\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('worker done', flush=True))).start()\n"
        "commands.main = lambda: 0\n"
        "commands.run()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "worker done\n", (r.stdout, r.stderr[-2000:])


def test_a_coordinator_that_served_a_download_exits_at_once(tmp_path: Path) -> None:
    """With the fast IO paths on, a download is sent from the send pool's threads; once the
    server stopped (SIGTERM), the coordinator stops that pool, so that nothing is left for the
    exit to wait for, and it ends without the teardown."""
    cfg_path, log, port = tmp_path / "run.json", tmp_path / "coordinator.log", free_port()
    cfg_path.write_text(tiny_config().model_dump_json())
    env = {"PYTHONVERBOSE": "1", "FEDTRAIN_FAST_IO": "1"}
    proc = start_coordinator(cfg_path, tmp_path / "state", port, log, env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {PTOKEN}"},
                          timeout=30) as http:
            assert http.post("/v1/join", json={"name": "a"}).status_code == 200
            version, params = download(http)
            assert version == 0 and params
    finally:
        stop_coordinator(proc)
    text = log.read_text()
    assert proc.returncode == 130 and "fedtrain coordinator: stopped" in text, text[-3000:]  # 130: stopped by a signal
    assert TORN_DOWN not in text, "the coordinator tore its modules down: a thread held its fast exit"
