"""The `fedtrain` command as a user meets it first: light startup (no torch, no server stack
for --help, --version, status, config), --version, a reader that goes away (`| head`),
one-line errors, the live config from the command line, token files, the coordinator's
"how to join" lines, a taken port, and data specs."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import fedtrain
from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers import zygote
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.processes import assert_clean_error, free_port, stop_coordinator
from tests.helpers.processes import fedtrain as run_cli

# xdist: one live coordinator process (module fixture) for the module
pytestmark = pytest.mark.xdist_group("cli_first_hour")

HEAVY = ("torch", "uvicorn", "fastapi", "starlette")
NO_TOKENS = {"FEDTRAIN_TOKEN": "", "FEDTRAIN_ADMIN_TOKEN": ""}

# Runs `fedtrain.cli.main(argv)` in a fresh interpreter and writes what it imported to a file,
# so the command's own stdout and stderr stay as a user sees them.
PROBE = """
import json, sys
from fedtrain.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as e:
    code = e.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "heavy": [m for m in HEAVY if m in sys.modules]}, f)
""".replace("HEAVY", repr(HEAVY))


def probe(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / f"probe-{time.monotonic_ns()}.json"
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert out.is_file(), r.stderr
    return json.loads(out.read_text()), r


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# ----------------------------------------------------------------------------- a coordinator process


class CoordinatorProcess:
    """`fedtrain coordinator --port 0` with no tokens given (so it generates an admin token and
    mints a first site's token), and
    the lines it printed once it serves."""

    def __init__(self, root: Path, **config: object) -> None:
        root.mkdir(parents=True, exist_ok=True)
        cfg = root / "run.json"
        cfg.write_text(json.dumps(tiny_config(**config).model_dump(mode="json")))
        self.state = root / "state"
        self.out, self.err = root / "stdout.txt", root / "stderr.txt"
        argv = [sys.executable, "-m", "fedtrain", "coordinator", "--config", str(cfg)]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = zygote.popen(
                [*argv, "--state-dir", str(self.state), "--port", "0"],
                stdout=out,
                stderr=err,
                env={**os.environ, **NO_TOKENS},
            )
        deadline = time.monotonic() + 90
        while "dashboard:" not in self.stdout():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.err.read_text()[-3000:]
            time.sleep(0.05)
        self.participant_line = next(
            line.split(": ", 1)[1] for line in self.stdout().splitlines() if line.startswith("start a participant:")
        )
        argv = shlex.split(self.participant_line)
        self.url = argv[argv.index("--coordinator") + 1]
        self.token_file = Path(argv[argv.index("--token-file") + 1])

    def stdout(self) -> str:
        return self.out.read_text()

    def tokens(self) -> dict:
        """The tokens it generated: the admin's, and the first site's (issue 31: apart)."""
        site = (self.state / "participant-tokens" / "site-1.token").read_text().strip()
        return {"participant": [site], "admin": (self.state / "admin-token").read_text().strip()}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    c = CoordinatorProcess(tmp_path_factory.mktemp("live"))
    try:
        yield c
    finally:
        stop_coordinator(c.proc)


# ----------------------------------------------------------------------------- light startup


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["status", "--help"],
        ["config", "--help"],
        ["config", "set", "--help"],
        ["participant", "--help"],
        ["coordinator", "--help"],
        ["recipes"],
    ],
)
def test_help_and_version_do_not_import_torch(tmp_path: Path, args: list[str]) -> None:
    seen, r = probe(tmp_path, *args)
    assert seen == {"code": 0, "heavy": []}, r.stderr


def test_status_and_config_without_a_coordinator_stay_light(tmp_path: Path) -> None:
    seen, r = probe(tmp_path, "status", "--coordinator", closed_port_url(), env=NO_TOKENS)
    assert seen == {"code": 2, "heavy": []} and "no token" in r.stderr
    seen, r = probe(tmp_path, "config", "show", "--coordinator", closed_port_url(), "--token", "t")
    assert seen == {"code": 2, "heavy": []}, r.stderr
    assert "Traceback" not in r.stderr and "fedtrain config show: error:" in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--json"],
        ["config", "show"],
        ["config", "history"],
        ["config", "validate", "outer.lr=0.5"],
    ],
)
def test_commands_against_a_live_coordinator_stay_light(
    tmp_path: Path, live: CoordinatorProcess, args: list[str]
) -> None:
    # an admin command takes the admin token: with --state-dir, from the coordinator's state dir
    given = ["--state-dir", str(live.state)] if "validate" in args else ["--token-file", str(live.token_file)]
    seen, r = probe(tmp_path, *args, "--coordinator", live.url, *given)
    assert seen == {"code": 0, "heavy": []}, r.stderr
    assert r.stdout.strip()


def test_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"fedtrain {fedtrain.__version__}" == "fedtrain 0.1.0"


# ----------------------------------------------------------------------------- pipes and OSErrors


# Both ways Python writes a pipe: buffered (the default: the error comes at the last flush)
# and unbuffered (PYTHONUNBUFFERED=1: at the first print).
BUFFERING = pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])


def run_with_stdout_closed(*args: str, unbuffered: str) -> subprocess.CompletedProcess:
    """Run `fedtrain ARGS` with a reader that has gone away before the first byte: every write
    to stdout fails with EPIPE (what `| head` does once it has its lines)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedtrain", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=120), "", err)


@BUFFERING
@pytest.mark.parametrize("json_out", [False, True])
def test_status_into_a_closed_pipe_ends_quietly(
    coordinator: BackgroundCoordinator, json_out: bool, unbuffered: str
) -> None:
    args = ["status", "--coordinator", coordinator.url, "--token", PTOKEN] + (["--json"] if json_out else [])
    r = run_with_stdout_closed(*args, unbuffered=unbuffered)
    assert r.stderr == "" and r.returncode == 141, (r.returncode, r.stderr)


@BUFFERING
@pytest.mark.parametrize("args", [["recipes"], ["recipes", "gpt-small"], ["config", "--help"], ["--help"]])
def test_help_and_recipes_into_a_closed_pipe_end_quietly(args: list[str], unbuffered: str) -> None:
    r = run_with_stdout_closed(*args, unbuffered=unbuffered)
    assert r.stderr == "", r.stderr
    # argparse itself drops a help text it cannot write unbuffered, and exits 0
    assert r.returncode == (0 if "--help" in args and unbuffered else 141)


@BUFFERING
def test_a_stdout_that_cannot_be_written_is_one_line(unbuffered: str) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "fedtrain", "recipes"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
        )
    assert r.returncode == 2, r.stderr
    # unbuffered, the command's own print fails; buffered, the last flush
    assert re.fullmatch(r"fedtrain( recipes)?: error: .*No space left on device\n", r.stderr), r.stderr


def test_an_oserror_of_a_command_is_one_line(tmp_path: Path, coordinator: BackgroundCoordinator) -> None:
    out = tmp_path / "no-such-dir" / "global.safetensors"
    r = run_cli("export", "--state-dir", str(coordinator.service.state_dir), "--out", str(out))
    assert_clean_error(r, "fedtrain export: error:", "No such file or directory", "no-such-dir")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# ----------------------------------------------------------------------------- fedtrain config


def cfg(coordinator: BackgroundCoordinator, *args: str, token: str = ATOKEN) -> subprocess.CompletedProcess:
    action, *rest = args
    return run_cli("config", action, "--coordinator", coordinator.url, "--token", token, *rest)


def test_config_show_set_validate_history(coordinator: BackgroundCoordinator) -> None:
    r = cfg(coordinator, "show", token=PTOKEN)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# config v1, in force at round 0\n")
    assert yaml.safe_load(r.stdout)["train"]["sync_every"] == 5

    r = cfg(coordinator, "validate", "train.sync_every=30")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "valid: train.sync_every: 5 -> 30; nothing applied"

    r = cfg(coordinator, "set", "train.sync_every=30", "outer.lr=0.5", "train.compression=bf16")
    assert r.returncode == 0, r.stderr
    accepted, note = r.stdout.strip().split("\n")
    assert accepted == (
        "config v2 accepted, in force from round 0: "
        "outer.lr: null -> 0.5, train.compression: none -> bf16, train.sync_every: 5 -> 30"
    )
    assert note.startswith("note: train.compression none -> bf16 applies from each participant's next upload")
    shown = json.loads(cfg(coordinator, "show", "--json", token=PTOKEN).stdout)
    assert shown["version"] == 2
    assert shown["config"]["train"]["sync_every"] == 30 and shown["config"]["outer"]["lr"] == 0.5

    r = cfg(coordinator, "set", "train.sync_every=30")
    assert r.returncode == 0 and r.stdout.strip() == "no change: config v2 has these values already"

    r = cfg(coordinator, "history", token=PTOKEN)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["version", "time", "author", "from", "round", "changes"]
    assert lines[2].startswith("v2 ") and "admin" in lines[2] and "train.sync_every: 5 -> 30" in lines[2]
    assert lines[3].startswith("v1 ") and "(the run's first config)" in lines[3]
    history = json.loads(cfg(coordinator, "history", "--json", token=PTOKEN).stdout)
    assert [v["version"] for v in history] == [2, 1]


@pytest.mark.parametrize(
    "action, change, words",
    [
        ("set", "train.sync_every=0", "train.sync_every: Input should be greater than or equal to 1"),
        ("validate", "train.sync_every=0", "train.sync_every: Input should be greater than or equal to 1"),
        ("set", "model.n_layer=3", "model.n_layer cannot change during a run"),
        ("validate", "model.n_layer=3", "model.n_layer cannot change during a run"),
        ("set", "train.no_such_field=1", "train.no_such_field: Extra inputs are not permitted"),
    ],
)
def test_config_refusals_are_the_coordinators_one_line(
    coordinator: BackgroundCoordinator, action: str, change: str, words: str
) -> None:
    r = cfg(coordinator, action, change)
    assert_clean_error(r, f"fedtrain config {action}: error: config change: {words}")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert json.loads(cfg(coordinator, "show", "--json").stdout)["version"] == 1  # nothing was applied


def test_config_changes_need_the_admin_token(coordinator: BackgroundCoordinator) -> None:
    for action in ("set", "validate"):
        r = cfg(coordinator, action, "outer.lr=0.5", token=PTOKEN)
        assert_clean_error(r, f"fedtrain config {action}: error:", "admin")
    assert json.loads(cfg(coordinator, "show", "--json").stdout)["version"] == 1


def test_config_bad_pairs_are_refused_before_connecting() -> None:
    url = closed_port_url()
    for pair, words in [
        ("train.sync_every", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("train..lr=1", "expected KEY=VALUE"),
        ("train.lr=", "give a value"),
    ]:
        r = run_cli("config", "set", "--coordinator", url, "--token", "t", pair)
        assert_clean_error(r, words)
        assert "did not answer" not in r.stderr and "refused" not in r.stderr


def test_config_admin_commands_take_the_admin_token_from_env_and_tokens_json(
    tmp_path: Path, coordinator: BackgroundCoordinator
) -> None:
    base = ["config", "set", "--coordinator", coordinator.url]
    r = run_cli(*base, "outer.lr=0.25", env={"FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": ATOKEN})
    assert r.returncode == 0, r.stderr
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"participant": [PTOKEN], "admin": ATOKEN}))
    r = run_cli(*base, "--token-file", str(tokens), "outer.lr=0.5", env=NO_TOKENS)
    assert r.returncode == 0, r.stderr
    assert "config v3 accepted" in r.stdout
    # read-only commands take the participant token of the same file
    r = run_cli("status", "--coordinator", coordinator.url, "--token-file", str(tokens), env=NO_TOKENS)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- token files


def test_token_file_forms(tmp_path: Path, coordinator: BackgroundCoordinator) -> None:
    status = ["status", "--coordinator", coordinator.url]
    plain = tmp_path / "token"
    plain.write_text(f"\n  {PTOKEN}\n")
    assert run_cli(*status, "--token-file", str(plain), env=NO_TOKENS).returncode == 0

    bad = tmp_path / "bad"
    for content, words in [
        ("", "expected one token, found nothing"),
        ("two words", "expected one token, found several words"),
        ('{"admin": "x"}', 'expected a tokens.json with a "participant" list'),
        ("{not json", "not valid JSON"),
    ]:
        bad.write_text(content)
        assert_clean_error(run_cli(*status, "--token-file", str(bad)), f"token file {bad}: {words}")
    assert_clean_error(
        run_cli(*status, "--token-file", str(tmp_path / "missing")), "cannot read the token file", "missing"
    )
    r = run_cli(*status, "--token", "t", "--token-file", str(plain))
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


@pytest.mark.parametrize("cmd", [["participant"], ["status"], ["export"], ["config", "show"], ["config", "set"]])
def test_help_says_token_shows_in_ps(cmd: list[str]) -> None:
    r = run_cli(*cmd, "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--token-file PATH" in text and "`ps`" in text and "FEDTRAIN_TOKEN" in text


# ----------------------------------------------------------------------------- the coordinator's lines


def test_coordinator_says_how_to_join_without_printing_a_token(live: CoordinatorProcess) -> None:
    out = live.stdout()
    tokens = live.tokens()
    for token in [*tokens["participant"], tokens["admin"]]:
        assert token not in out
    assert live.token_file == (live.state / "participant-tokens" / "site-1.token").absolute()
    assert live.token_file.read_text().strip() == tokens["participant"][0]  # that site's token alone
    assert not (live.state / "tokens.json").exists()
    assert live.participant_line == (
        f"fedtrain participant --coordinator {live.url} --token-file {live.token_file} --data stdlib:0/4"
    )
    assert f"dashboard: {live.url}/ " in out
    # the printed flags reach the run: the same URL and token file, through `status`
    r = run_cli("status", "--coordinator", live.url, "--token-file", str(live.token_file), env=NO_TOKENS)
    assert r.returncode == 0 and "run 'test': round 0/3" in r.stdout, r.stderr


def test_coordinator_with_tokens_from_env_points_at_the_env(tmp_path: Path) -> None:
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(tiny_config().model_dump(mode="json")))
    env = {**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": ATOKEN}
    argv = [sys.executable, "-m", "fedtrain", "coordinator", "--config", str(cfg_path), "--port", "0"]
    with open(tmp_path / "out.txt", "wb") as out:
        proc = zygote.popen([*argv, "--state-dir", str(tmp_path / "s")], stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 90
        while "dashboard:" not in (text := (tmp_path / "out.txt").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.05)
    finally:
        stop_coordinator(proc)
    assert "--token-file" not in text and PTOKEN not in text and ATOKEN not in text
    assert "(with FEDTRAIN_TOKEN set to one of this run's participant tokens)" in text
    assert not (tmp_path / "s" / "tokens.json").exists()


def test_the_printed_participant_line_trains(tmp_path: Path) -> None:
    c = CoordinatorProcess(tmp_path / "run", rounds=1)
    try:
        argv = shlex.split(c.participant_line)
        assert argv[:2] == ["fedtrain", "participant"]
        r = zygote.run([sys.executable, "-m", "fedtrain", *argv[1:], "--give-up-after", "30"], text=True,
                       timeout=280, env={**os.environ, **NO_TOKENS})
        assert r.returncode == 0, r.stderr[-3000:]
        status = run_cli("status", "--coordinator", c.url, "--token-file", str(c.token_file), "--json")
        assert json.loads(status.stdout)["finished"], status.stderr
    finally:
        stop_coordinator(c.proc)


def test_taken_port_creates_no_state(tmp_path: Path) -> None:
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(tiny_config().model_dump(mode="json")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        for state in (tmp_path / "new", empty):
            r = run_cli(
                "coordinator", "--config", str(cfg_path), "--state-dir", str(state), "--port", str(port), env=NO_TOKENS
            )
            assert_clean_error(r, f"error: cannot listen on 127.0.0.1:{port}: Address already in use")
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "new").exists()
    assert list(empty.iterdir()) == []


# ----------------------------------------------------------------------------- data specs


@pytest.mark.parametrize(
    "spec, words",
    [
        ("stdlib:0/0", "data spec 'stdlib:0/0': the number of shards N must be at least 1"),
        ("stdlib:4/4", "data spec 'stdlib:4/4': shard K must be in 0..3"),
    ],
)
def test_stdlib_shard_spec_messages(spec: str, words: str) -> None:
    r = run_cli("participant", "--coordinator", closed_port_url(), "--token", "t", "--data", spec)
    assert_clean_error(r, words)
    assert "-1" not in r.stderr
