"""The test harness's forked processes (`tests/helpers/zygote.py`) behave as cold ones do: their
own environment, directory, streams, exit status and signals; a setting that acts only at an
interpreter's start gets a cold process; a rank forked through torchrun's `--no-python` entry
ends as the rank did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import zygote

PROBE = (
    "import json, os, sys, tempfile, torch\n"
    "print(json.dumps({'pid': os.getpid(), 'cwd': os.getcwd(), 'x': os.environ.get('X'), 'argv': sys.argv[1:],\n"
    "                  'tmp': tempfile.gettempdir(), 'threads': torch.get_num_threads()}))\n"
    "print('to stderr', file=sys.stderr)\n"
    "sys.exit(int(sys.argv[1]))\n"
)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def test_a_forked_process_has_its_own_environment_directory_streams_and_status(probe: Path, tmp_path: Path) -> None:
    env = {**os.environ, "X": "y", "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "2"}  # (the template's: 1)
    proc = zygote.popen([sys.executable, str(probe), "3", "more"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    assert isinstance(proc, zygote.Forked)
    out, err = proc.communicate(timeout=60)
    seen = json.loads(out)
    assert proc.returncode == 3 and err == "to stderr\n"
    assert seen == {"pid": proc.pid, "cwd": str(tmp_path), "x": "y", "argv": ["3", "more"], "tmp": str(tmp_path),
                    "threads": 2}
    assert seen["pid"] != os.getpid()


def test_a_forked_process_killed_by_a_signal_reports_it_as_popen_does(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = zygote.popen([sys.executable, "-u", str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_setting_read_at_interpreter_start_gets_a_cold_process(probe: Path) -> None:
    cold = zygote.popen([sys.executable, str(probe), "0"], env={**os.environ, "PYTHONVERBOSE": "1"},
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert isinstance(cold, subprocess.Popen)
    assert cold.wait(timeout=60) == 0
    assert isinstance(zygote.popen([sys.executable, "-c", "pass"]), subprocess.Popen)  # `-c`: always cold


def test_a_forked_process_is_killed_when_its_client_goes_away(tmp_path: Path) -> None:
    """The template kills a child whose request's connection closed: a test process that died
    leaves nothing running."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = zygote.popen([sys.executable, "-u", str(script)], stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, zygote.Forked) and proc.stdout is not None and proc.stdout.readline() == "up\n"
    child = psutil.Process(proc.pid)
    proc.disown()  # what the test process's death does to the connection
    gone, _ = psutil.wait_procs([child], timeout=30)
    assert gone


def test_a_rank_through_the_entry_gets_its_signals_and_ends_as_the_rank_did(tmp_path: Path) -> None:
    """`zygote_exec.py` (torchrun's `--no-python` entry) passes the signals torchrun sends on to
    the forked rank, and ends with the rank's status, or by the rank's signal."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(7))\n"
        "print(os.environ['RANK'], flush=True)\n"
        "time.sleep(60)\n"
    )
    args, env = zygote.rank_launch({**os.environ, "RANK": "1"})
    entry = args[-1]
    for sig, status in ((signal.SIGUSR1, 7), (signal.SIGTERM, -signal.SIGTERM)):
        proc = subprocess.Popen([entry, "-u", str(script)], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "1\n"
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == status  # 7: the rank's own handler ran, so the signal reached it


def test_a_nested_process_has_its_python_children_forked_too(tmp_path: Path) -> None:
    """`nested=True`: the process's own `python script.py` children are forked by the template
    (they start with torch imported), pass their status and SIGTERM on as a cold child would;
    without it they start cold."""
    child = tmp_path / "child.py"
    child.write_text("import sys, time\nprint('torch' in sys.modules, flush=True)\n"
                     "if sys.argv[1:] == ['wait']:\n    time.sleep(60)\nsys.exit(5)\n")
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys\n"
        f"done = subprocess.run([sys.executable, {str(child)!r}], capture_output=True, text=True)\n"
        f"waiting = subprocess.Popen([sys.executable, '-u', {str(child)!r}, 'wait'], stdout=subprocess.PIPE,\n"
        "                           text=True)\n"
        "first = waiting.stdout.readline().strip()\n"
        "waiting.terminate()\n"
        "print(done.stdout.strip(), done.returncode, first, waiting.wait())\n"
    )
    for nested, forked in ((True, "True"), (False, "False")):
        r = zygote.run([sys.executable, str(parent)], timeout=120, text=True, nested=nested)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [forked, "5", forked, str(-signal.SIGTERM)], (nested, r.stdout)
