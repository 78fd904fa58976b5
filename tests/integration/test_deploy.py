"""The deployment kit (deploy/, docs/deploy.md), tested where it can be on this machine.

- nginx: a run goes through a real nginx (Debian's package) configured with the shipped site
  config (`deploy/nginx/fedtrain.conf`, quoted by docs/deploy.md), over TLS: the dashboard, the
  event stream (an event arrives while it is open), a join, the round's long poll, uploads
  larger than nginx's default body limit, an upload over the run's limit (the coordinator's own
  answer, not nginx's), and the model download, by two real participants and by hand.
- The image: the Containerfile's steps checked against the repository (what it copies exists,
  pip uses constraints.txt, a non-root user, the state dir a volume, a health check that is a
  real route), the health check script run against a coordinator, and, where podman is
  installed, the image built from a stub base (no registry here: nothing is pulled).
- compose, Kubernetes and Slurm: every file parses, every command line in them is one the
  `fedtrain` (and torchrun) parsers accept, the secrets script writes what they read, and the
  sbatch script runs under a fake srun, one launcher per node, rendezvous on the first node.

Not run here (no registry, no cluster, no Slurm): pulling a base image and installing torch in
it, running the containers, `kubectl apply`, `sbatch`. docs/deploy.md says so too.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import sqlite3
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedtrain.cli import build_parser
from fedtrain.config import load_config
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant.client.coordinator_client import sse_events
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.api import download, upload
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.nginx import SITE_TEMPLATE, Nginx, nginx_binary
from tests.helpers.tiny import Regression, Small, TinyParticipant, TrainingThread, init_file, run_all

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOC = ROOT / "docs" / "deploy.md"

WIDTH = 100_000
"""`Small(WIDTH)` has 5 x WIDTH + 1 weights: an update of 2 MB, twice nginx's default body limit (1m)."""
UPLOAD_MB = 4
"""The run's max_upload_mb, and nginx's client_max_body_size in MiB (a little more: the
coordinator's own limit answers first)."""
STREAM_READ_S = 20.0
"""How long the test waits for the next bytes of the event stream (the coordinator's keep-alive
comes every 15 s): an event held in a proxy's buffer fails the test here."""


@pytest.fixture
def nginx() -> str:
    # In CI (.ci/run installs it) a missing nginx is a failure, never a silent skip.
    found = nginx_binary()
    if found is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("the nginx tests need nginx: apt-get install -y nginx")
    return found


def make_certs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key) for 127.0.0.1, made by deploy/make-certs.sh (the script
    docs/deploy.md shows), run twice: the certificates used are a renewal's."""
    out = tmp_path / "certs"
    for renewal in (False, True):  # the second run renews the server certificate under the same CA
        made = subprocess.run(["sh", str(DEPLOY / "make-certs.sh"), "localhost", "IP:127.0.0.1", str(out)],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        if not renewal:
            ca_first, server_first = (out / "ca.pem").read_bytes(), (out / "server.pem").read_bytes()
    assert (out / "ca.pem").read_bytes() == ca_first and (out / "server.pem").read_bytes() != server_first
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == stat.S_IMODE((out / "server.key").stat().st_mode) == 0o600
    return out / "ca.pem", out / "server.pem", out / "server.key"


def test_a_run_goes_through_nginx_with_the_shipped_config(tmp_path: Path, nginx: str) -> None:
    ca, cert, key = make_certs(tmp_path)
    cfg = tiny_config(rounds=3, train={"sync_every": 2}, max_upload_mb=UPLOAD_MB, outer={"algorithm": "fedavg"})
    wide = functools.partial(Small, WIDTH)
    trust = ssl.create_default_context(cafile=str(ca))
    with (
        BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, wide())) as c,
        Nginx(tmp_path / "nginx", upstream=c.url, cert=cert, key=key, max_body=f"{UPLOAD_MB}m") as proxy,
        httpx.Client(base_url=proxy.url, verify=trust, timeout=30) as browser,
        httpx.Client(base_url=proxy.url, verify=trust, timeout=30,
                     headers={"Authorization": f"Bearer {PTOKEN}"}) as http,
    ):
        # The dashboard: its page and what the page loads.
        page = browser.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assets = re.findall(r'(?:src|href)="(static/[^"]+)"', page.text)
        assert assets and all(browser.get("/" + a).status_code == 200 for a in assets), assets

        # The event stream as the dashboard opens it (token in the query) stays open through the
        # proxy, and an event arrives on it as it happens: a join made after it opened.
        with browser.stream("GET", "/v1/stream", params={"token": ATOKEN},
                            timeout=httpx.Timeout(30, read=STREAM_READ_S)) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            events = sse_events(stream.iter_lines())
            assert next(events)[0] == "hello"
            joined = http.post("/v1/join", json={"name": "probe"})
            assert joined.status_code == 200, joined.text
            _, data = next(events)
            while "probe" not in json.dumps(data):  # bounded: each read waits STREAM_READ_S at most
                _, data = next(events)

        # An upload over the run's limit gets the coordinator's own answer (JSON), not nginx's page.
        over = b"\0" * (UPLOAD_MB * 10**6 + 1000)
        refused = http.put("/v1/rounds/0/updates/probe", params={"tokens": 1}, content=over,
                           headers={DIGEST_HEADER: "xxh3-128:" + "0" * 32})
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["code"] == "too_large" and "max_upload_mb" in refused.json()["error"]["message"]
        # The round's long poll, held through the proxy until the probe's upload (2 MB) closes the round.
        poll = TrainingThread(lambda: http.get("/v1/rounds/0", params={"wait": 30})).start()
        zeros = {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}
        assert EncodedBody(zeros).content_length > 2**20  # more than nginx's default limit (1m)
        accepted = upload(http, 0, "probe", zeros)
        assert accepted.status_code == 200 and accepted.json()["accepted"], accepted.text
        answer = poll.join(timeout=60)
        assert answer.status_code == 200 and answer.json()["state"] == "closed", answer.text
        assert http.post("/v1/participants/probe/leave").status_code == 200

        # Two real participants over TLS through nginx: join, upload, long poll, download.
        sites = [TinyParticipant(proxy.url, f"site-{i}", Regression(rows=8, seed=i, lr=1e-5, model=wide),
                                 verify=str(ca)) for i in range(2)]
        run_all(sites, timeout=120)
        assert c.service.version == 3
        final = c.service.inspect().weights
        for site in sites:
            assert site.fed is not None and site.fed.round == 3
            for name, t in final.items():
                assert torch.equal(site.weights[name], t), (site.name, name)

        # A download by hand, checked against the coordinator's weights.
        version, got = download(http)
        assert version == 3 and got.keys() == final.keys() and all(torch.equal(got[n], t) for n, t in final.items())

    # All of it went through nginx, not around it, and the log holds no token.
    log = proxy.access_log.read_text()
    for seen in ("GET /v1/model", "GET /v1/stream", "POST /v1/join", "GET /v1/rounds/0"):
        assert seen in log, seen
    for site in sites:  # which rounds a site's updates went to depends on when it joined
        assert re.search(rf"PUT /v1/rounds/\d+/updates/{site.name} HTTP/1.1\" 200 ", log), site.name
    assert ATOKEN not in log and PTOKEN not in log


@pytest.mark.slow
def test_the_longest_long_poll_goes_through_nginx(tmp_path: Path, nginx: str) -> None:
    """The API's longest wait (60 s) is answered through the shipped config. Under nginx's
    default read timeout (60 s) it is a race between the answer and nginx's 504 (the answer won
    when it was tried here); a read timeout under the wait gives the 504 every time."""
    ca, cert, key = make_certs(tmp_path)
    with (
        BackgroundCoordinator(tmp_path / "state", tiny_config(), init_weights=init_file(tmp_path, Small())) as c,
        Nginx(tmp_path / "nginx", upstream=c.url, cert=cert, key=key, max_body="4m") as proxy,
        httpx.Client(base_url=proxy.url, verify=ssl.create_default_context(cafile=str(ca)), timeout=90,
                     headers={"Authorization": f"Bearer {PTOKEN}"}) as http,
    ):
        r = http.get("/v1/rounds/0", params={"wait": 60})  # nobody submits: answered when the wait is spent
        assert r.status_code == 200 and r.json()["state"] == "open", r.text


def test_the_doc_shows_the_nginx_config_the_tests_run() -> None:
    """One source: docs/deploy.md quotes deploy/nginx/fedtrain.conf and deploy/make-certs.sh
    whole (the tests run both), and the Ingress' annotations carry the nginx file's settings."""
    template = SITE_TEMPLATE.read_text()
    doc = DOC.read_text()
    assert f"```nginx\n{template}```" in doc
    assert f"```sh\n{(DEPLOY / 'make-certs.sh').read_text()}```" in doc
    directives = dict(re.findall(r"^\s*(proxy_\w+|client_max_body_size)\s+([^;]+);", template, re.M))
    ingress = yaml.safe_load((DEPLOY / "k8s" / "ingress.yaml").read_text())
    notes = {k.removeprefix("nginx.ingress.kubernetes.io/"): v for k, v in ingress["metadata"]["annotations"].items()}
    assert notes["proxy-buffering"] == directives["proxy_buffering"] == "off"
    assert notes["proxy-request-buffering"] == directives["proxy_request_buffering"] == "off"
    assert notes["proxy-http-version"] == directives["proxy_http_version"] == "1.1"
    for which in ("read", "send"):
        assert notes[f"proxy-{which}-timeout"] + "s" == directives[f"proxy_{which}_timeout"]
        assert int(notes[f"proxy-{which}-timeout"]) > 60  # the longest long poll
    run = _k8s("coordinator.yaml")["ConfigMap"][0]["data"]["run.yaml"]
    assert int(notes["proxy-body-size"].removesuffix("m")) >= yaml.safe_load(run)["max_upload_mb"]


# -- commands in the kit: accepted by the parsers they reach --------------------------------------


def parse_fedtrain(argv: list[str]) -> argparse.Namespace:
    """`fedtrain ARGS...` as the command would parse it; under `fedtrain torchrun`, torchrun's own
    parser first, then the participant's arguments (`-m fedtrain participant ...`)."""
    assert argv[0] == "fedtrain", argv
    if argv[1] != "torchrun":
        return _parse(build_parser(), argv[1:])
    from torch.distributed.run import get_args_parser

    launcher = _parse(get_args_parser(), argv[2:])
    assert launcher.module and launcher.training_script == "fedtrain", argv
    args = _parse(build_parser(), launcher.training_script_args)
    args.launcher = launcher
    return args


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{parser.prog} refuses {shlex.join(argv)}")


def containerfile() -> list[tuple[str, str]]:
    """deploy/Containerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", (DEPLOY / "Containerfile").read_text())
    steps = [line.strip().split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(s[0].upper(), s[1] if len(s) > 1 else "") for s in steps]


def args_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def exec_form(steps: list[tuple[str, str]], kind: str) -> list[str]:
    (found,) = [json.loads(a) for k, a in steps if k == kind]
    return found


def test_the_containerfile_steps_match_the_repository() -> None:
    steps = containerfile()
    args = args_of(steps)
    kinds = [k for k, _ in steps]
    assert kinds[0] == "ARG" and args["BASE"].split(":")[-1].startswith("3.11")  # the tested Python
    assert "cpu" in args["TORCH_INDEX"]
    # Every COPY takes files that exist in the repository.
    copied = {}
    for kind, a in steps:
        if kind == "COPY":
            *sources, dest = a.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
                copied[src] = dest
    assert "readme" in (ROOT / "pyproject.toml").read_text() and "README.md" in copied  # pip install . reads it
    # pip always with the tested versions; torch first, from TORCH_INDEX; then the package.
    pips = [expand(a, args) for k, a in steps if k == "RUN" and "pip install" in a]
    assert len(pips) == 2 and all("-c constraints.txt" in p for p in pips), pips
    first_pip = min(i for i, (k, a) in enumerate(steps) if k == "RUN" and "pip install" in a)
    assert steps.index(("COPY", "constraints.txt ./")) < first_pip
    assert f"--index-url {args['TORCH_INDEX']}" in pips[0] and pips[0].endswith(" torch")
    assert pips[1].endswith(" .")
    second_pip = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "pip install" in a][1]
    for what_pip_reads in ("pyproject.toml README.md ./", "src ./src"):
        assert steps.index(("COPY", what_pip_reads)) < second_pip
    # The services run as a user that is not root, numeric (Kubernetes' runAsNonRoot checks it).
    (user,) = [expand(a, args) for k, a in steps if k == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and gid != 0 and kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    coordinator = _k8s("coordinator.yaml")["StatefulSet"][0]["spec"]["template"]["spec"]["securityContext"]
    assert coordinator["runAsUser"] == uid and coordinator["fsGroup"] == gid
    # The default command is the coordinator, on the state dir that is a volume, on the exposed port.
    cmd = parse_fedtrain(exec_form(steps, "ENTRYPOINT") + exec_form(steps, "CMD"))
    (volume,) = [a for k, a in steps if k == "VOLUME"]
    (port,) = [a for k, a in steps if k == "EXPOSE"]
    assert cmd.command == "coordinator" and str(cmd.state_dir) == volume and str(cmd.port) == port
    assert cmd.host == "0.0.0.0"
    # The health check runs the script the image copies, whose default URL is that port's /v1/healthz.
    (health,) = [a for k, a in steps if k == "HEALTHCHECK"]
    script = health.split("CMD", 1)[1].strip()
    assert json.loads(script) == ["python", copied["deploy/healthcheck.py"]]
    url = httpx.URL(_healthcheck_default())
    assert (url.host, url.port, url.path) == ("127.0.0.1", int(port), "/v1/healthz")


def _healthcheck_default() -> str:
    text = (DEPLOY / "healthcheck.py").read_text()
    (url,) = re.findall(r'^DEFAULT_URL = "([^"]+)"', text, re.M)
    return url


def test_the_health_check_script_against_a_coordinator(tmp_path: Path) -> None:
    _, cert, key = make_certs(tmp_path)
    script = [sys.executable, str(DEPLOY / "healthcheck.py")]

    def check(url: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "FEDTRAIN_HEALTH_URL": url}
        return subprocess.run(script, env=env, capture_output=True, text=True, timeout=30)

    path = httpx.URL(_healthcheck_default()).path
    with BackgroundCoordinator(tmp_path / "plain", tiny_config(), init_weights=init_file(tmp_path, Small())) as c:
        assert check(c.url + path).returncode == 0
        url = c.url
        wrong = check(c.url + "/v1/nowhere")
        assert wrong.returncode == 1 and "404" in wrong.stderr
    down = check(url + path)
    assert down.returncode == 1 and url in down.stderr  # nobody listens any more
    # A coordinator serving TLS itself, with a certificate for another name: still answers.
    with BackgroundCoordinator(tmp_path / "tls-state", tiny_config(), init_weights=init_file(tmp_path, Small()),
                               tls_cert=cert, tls_key=key) as c:
        assert check(c.url + path).returncode == 0


def _write_stub_base(root: Path) -> Path:
    """A rootfs tarball with bash, mkdir and chown from this machine, and stubs for groupadd,
    useradd, pip and python that write their arguments to /stub-calls."""
    for d in ("usr/bin", "usr/sbin"):
        (root / d).mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "sbin").symlink_to("usr/sbin")
    for tool in ("bash", "mkdir", "chown"):
        found = shutil.which(tool)
        assert found, tool
        shutil.copy2(found, root / "usr/bin" / tool)
        libs = subprocess.run(["ldd", found], capture_output=True, text=True, check=True).stdout
        for lib in re.findall(r"(/\S+)", libs):
            dest = root / lib.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib, dest)
    (root / "usr/bin/sh").symlink_to("bash")
    for name, where in (("groupadd", "usr/sbin"), ("useradd", "usr/sbin"), ("pip", "usr/bin"), ("python", "usr/bin")):
        stub = root / where / name
        stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "{name} $*" >> /stub-calls\n')
        stub.chmod(0o755)
    tarball = root.parent / "base.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
    return tarball


def test_the_image_builds_with_podman_from_a_stub_base(tmp_path: Path) -> None:
    """Where podman is installed: the Containerfile built as written, FROM a base image made here
    (no registry can be reached: nothing is pulled), whose pip, python, useradd and groupadd are
    stubs. What this shows: the builder accepts every instruction, the build args reach the steps,
    and the image carries the user, the volume, the health check and the command. What it does not:
    that pip installs torch and fedtrain (no index here), nor that the container runs."""
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed (apt-get install -y podman); the Containerfile's steps are checked "
                    "without it by test_the_containerfile_steps_match_the_repository")
    short = Path(tempfile.mkdtemp(prefix="ft-podman-"))  # podman takes a runroot of 50 characters at most
    store = ["--root", str(short / "storage"), "--runroot", str(short / "run"), "--storage-driver", "overlay",
             "--events-backend", "file", "--cgroup-manager", "cgroupfs"]

    def pod(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([podman, *store, *args], capture_output=True, text=True, timeout=120)

    try:
        base = _write_stub_base(tmp_path / "rootfs")
        imported = pod("import", str(base), "localhost/fedtrain-stub-base:1")
        if imported.returncode != 0:  # e.g. rootless podman without subuids: the machine, not the Containerfile
            pytest.skip(f"podman cannot store an image here: {imported.stderr.strip()[-300:]}")
        index = "https://example.org/whl/cu124"
        # chroot isolation: RUN steps without an OCI runtime (crun cannot set up cgroups in this sandbox).
        built = pod("build", "--isolation", "chroot", "--layers=false", "--format", "docker",
                    "-f", str(DEPLOY / "Containerfile"), "--build-arg", "BASE=localhost/fedtrain-stub-base:1",
                    "--build-arg", f"TORCH_INDEX={index}", "-t", "localhost/fedtrain-test", str(ROOT))
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        (image,) = json.loads(pod("image", "inspect", "localhost/fedtrain-test").stdout)
        config = image["Config"]
        steps = containerfile()
        assert config["User"] == expand(dict(steps)["USER"], args_of(steps))
        assert list(config["Volumes"]) == ["/var/lib/fedtrain"] and config["WorkingDir"] == "/var/lib/fedtrain"
        assert config["Entrypoint"] + config["Cmd"] == exec_form(steps, "ENTRYPOINT") + exec_form(steps, "CMD")
        assert image["Healthcheck"]["Test"] == ["CMD", "python", "/usr/local/bin/fedtrain-healthcheck"]
        made = pod("create", "localhost/fedtrain-test")
        assert made.returncode == 0, made.stderr
        files = subprocess.run([podman, *store, "export", made.stdout.strip()], capture_output=True, timeout=60)
        assert files.returncode == 0, files.stderr
        listing = subprocess.run(["tar", "-t"], input=files.stdout, capture_output=True, check=True).stdout.decode()
        for path in ("opt/fedtrain/constraints.txt", "opt/fedtrain/src/fedtrain/__init__.py",
                     "usr/local/bin/fedtrain-healthcheck", "var/lib/fedtrain/"):
            assert path in listing.splitlines(), path
        calls = subprocess.run(["tar", "-xO", "stub-calls"], input=files.stdout, capture_output=True,
                               check=True).stdout.decode().splitlines()
        assert calls[2] == f"pip install -c constraints.txt --index-url {index} --extra-index-url " \
                           f"{args_of(steps)['PYPI_INDEX']} torch", calls
        assert calls[3].startswith("pip install -c constraints.txt") and calls[3].endswith(" ."), calls
    finally:
        pod("rm", "--all", "--force")
        pod("rmi", "--all", "--force")
        shutil.rmtree(short, ignore_errors=True)


def test_the_secrets_script_writes_one_token_per_site(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    made = subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(out), "site-a", "site-b", "site-c"],
                          capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    env = {f.stem: dict(line.split("=", 1) for line in f.read_text().splitlines()) for f in out.glob("*.env")}
    assert set(env) == {"coordinator", "site-a", "site-b", "site-c"}
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    sites = [env[s]["FEDTRAIN_TOKEN"] for s in ("site-a", "site-b", "site-c")]
    assert env["coordinator"]["FEDTRAIN_TOKEN"].split(",") == sites and len(set(sites)) == 3
    admin = env["coordinator"]["FEDTRAIN_ADMIN_TOKEN"]
    assert admin not in sites and all(set(e) == {"FEDTRAIN_TOKEN"} for s, e in env.items() if s != "coordinator")
    assert all(t.startswith("ft_") and len(t) >= 40 for t in [*sites, admin])
    # Run again: the tokens of the run stay as they are.
    before = {f.name: f.read_text() for f in out.iterdir()}
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(out)], capture_output=True, timeout=30, check=True)
    assert {f.name: f.read_text() for f in out.iterdir()} == before
    bad = subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(tmp_path / "x"), "no/slash"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "bad site name" in bad.stderr


def test_compose_starts_a_coordinator_and_two_participants() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"coordinator", "site-a", "site-b"}
    steps = containerfile()
    entry = exec_form(steps, "ENTRYPOINT")
    (volume,) = [a for k, a in steps if k == "VOLUME"]
    for svc in services.values():
        assert svc["build"]["dockerfile"] == "deploy/Containerfile"
        assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT
        assert set(svc["build"]["args"]) <= set(args_of(steps))
    coordinator = parse_fedtrain(entry + services["coordinator"]["command"])
    assert coordinator.command == "coordinator" and str(coordinator.state_dir) == volume
    (mount,) = services["coordinator"]["volumes"]
    name, path = mount.split(":")
    assert path == volume and name in compose["volumes"]  # a named volume: kept by `down`
    assert load_config(coordinator.config).name
    names = set()
    for site in ("site-a", "site-b"):
        svc = services[site]
        args = parse_fedtrain(entry + svc["command"])
        url = httpx.URL(args.coordinator)
        assert args.command == "participant" and url.host == "coordinator" and url.port == coordinator.port
        assert args.name == site and str(args.run_dir).startswith(volume) and args.token is None
        assert svc["env_file"] == f"secrets/{site}.env"  # make-secrets.sh's file: its token only
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert svc["healthcheck"] == {"disable": True}
        names.add(args.data)
    assert len(names) == 2  # each site its own shard
    assert services["coordinator"]["env_file"] == "secrets/coordinator.env"
    assert "/secrets/" in (DEPLOY / ".gitignore").read_text().split()


def _k8s(name: str) -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()):
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def test_the_kubernetes_manifests(tmp_path: Path) -> None:
    entry = exec_form(containerfile(), "ENTRYPOINT")
    coord = _k8s("coordinator.yaml")
    (sts,) = coord["StatefulSet"]
    (service,) = coord["Service"]
    (config_map,) = coord["ConfigMap"]
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == service["metadata"]["name"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_fedtrain(entry + container["args"])
    assert args.command == "coordinator" and args.host == "0.0.0.0"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert mounts[claim["metadata"]["name"]] == str(args.state_dir)
    # The run config it reads is one the coordinator accepts.
    (run_file,) = config_map["data"]
    assert str(args.config) == f"{mounts['run-config']}/{run_file}"
    (tmp_path / run_file).write_text(config_map["data"][run_file])
    assert load_config(tmp_path / run_file).max_upload_mb == 1024
    # Tokens from the Secret, by the names the coordinator reads; probes on the health route.
    (secret,) = _k8s("secret.example.yaml")["Secret"]
    assert set(secret["stringData"]) == {"FEDTRAIN_TOKEN", "FEDTRAIN_ADMIN_TOKEN"}
    assert container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == httpx.URL(_healthcheck_default()).path
    assert pod["securityContext"]["runAsNonRoot"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and service["spec"]["ports"][0]["targetPort"] == "http"
    # The Ingress: TLS, to that Service.
    (ingress,) = _k8s("ingress.yaml")["Ingress"]
    (rule,) = ingress["spec"]["rules"]
    assert ingress["spec"]["tls"][0]["hosts"] == [rule["host"]] and ingress["spec"]["tls"][0]["secretName"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"] and backend["port"]["name"] == "http"
    # The participant Job: a torchrun group, its own token, a run dir on its volume.
    job_kinds = _k8s("participant-job.yaml")
    (job,) = job_kinds["Job"]
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    part = parse_fedtrain(entry + worker["args"])
    assert part.command == "participant" and int(part.launcher.nproc_per_node) == 2 and part.launcher.standalone
    assert httpx.URL(part.coordinator).host == rule["host"] and httpx.URL(part.coordinator).scheme == "https"
    assert worker["envFrom"] == [{"secretRef": {"name": "fedtrain-site-token"}}] and part.token is None
    wmounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert str(part.run_dir).startswith(wmounts["run"])
    (pvc,) = job_kinds["PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


FAKE_SLURM = {
    "scontrol": '[ "$1 $2" = "show hostnames" ] || exit 9\nfor h in node-17 node-18 node-19; do echo $h; done\n',
    # srun: the command once per node, as that node's task, one after the other.
    "srun": 'while [ "${1#-}" != "$1" ]; do echo "$1" >> "$LOG/srun-options"; shift; done\n'
            'for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i "$@" || exit $?; done\n',
    "fedtrain": 'printf "%s\\0" fedtrain "$@" > "$LOG/launch-$SLURM_NODEID"\n',
}


def test_the_slurm_script_runs_one_launcher_per_node(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LOG": str(tmp_path),
           "SLURM_JOB_NODELIST": "node-[17-19]", "SLURM_NNODES": "3", "SLURM_JOB_ID": "4242",
           "SLURM_GPUS_ON_NODE": "4"}
    script = str(DEPLOY / "slurm" / "participant.sbatch")
    missing = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "FEDTRAIN_COORDINATOR" in missing.stderr  # says what to set
    env |= {"FEDTRAIN_COORDINATOR": "https://fedtrain.example.org", "FEDTRAIN_TOKEN_FILE": "/etc/site.token",
            "FEDTRAIN_DATA": "/scratch/text", "FEDTRAIN_NAME": "site-hpc", "FEDTRAIN_CA_CERT": "/etc/ca.pem"}
    ran = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    launches = [(tmp_path / f"launch-{i}").read_bytes().decode().split("\0")[:-1] for i in range(3)]
    assert launches[0] == launches[1] == launches[2]  # the same command on every node
    args = parse_fedtrain(launches[0])
    torchrun = args.launcher
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("3", "4")
    assert torchrun.rdzv_backend == "c10d" and torchrun.rdzv_endpoint == "node-17:29500"  # the first node
    assert torchrun.rdzv_id == "4242"
    assert args.command == "participant" and args.coordinator == env["FEDTRAIN_COORDINATOR"]
    assert (args.token_file, args.ca_cert, args.name, args.device) == (
        Path("/etc/site.token"), "/etc/ca.pem", "site-hpc", "cuda")
    assert str(args.run_dir) == f"{tmp_path}/fedtrain-run/site-hpc" and args.run_dir.is_dir()
    assert "--ntasks-per-node=1" in (tmp_path / "srun-options").read_text().split()
    # Without the optional CA: no --ca-cert at all (bash's `set -u` and an empty array).
    del env["FEDTRAIN_CA_CERT"]
    ran = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    assert "--ca-cert" not in (tmp_path / "launch-0").read_bytes().decode().split("\0")


def test_a_live_state_dir_backed_up_and_restored(tmp_path: Path) -> None:
    """deploy/backup_state.py on a coordinator that commits rounds all the while (keeping 2
    versions, so files are removed and reused under it): each backup is one a coordinator
    resumes from, at the version its database names, with that version's weights."""
    script = [sys.executable, str(DEPLOY / "backup_state.py")]
    cfg = tiny_config(rounds=0, train={"sync_every": 1}, keep_checkpoints=2, outer={"algorithm": "fedavg"})
    backups: list[Path] = []
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, Small())) as c:
        stop = threading.Event()
        site = TinyParticipant(c.url, "site", Regression(rows=4, seed=0), stop=stop).start()
        try:
            while len(backups) < 3:
                assert site.is_alive(), site.error
                if c.service.version <= 2 * len(backups) + 1:  # a few rounds between two backups
                    time.sleep(0.01)
                    continue
                dest = tmp_path / f"backup-{len(backups)}"
                made = subprocess.run([*script, str(tmp_path / "state"), str(dest)], capture_output=True, text=True,
                                      timeout=60)
                assert made.returncode == 0, made.stderr
                backups.append(dest)
        finally:
            stop.set()
            site.join(timeout=60)
        refused = subprocess.run([*script, str(tmp_path / "state"), str(backups[0])], capture_output=True, text=True)
        assert refused.returncode == 1 and "not empty" in refused.stderr
    versions = []
    for dest in backups:
        assert {p.name for p in dest.iterdir()} == {"run.db", "checkpoints"}  # no lock, spool, -wal or -shm
        with sqlite3.connect(dest / "run.db") as db:
            (version,) = db.execute("SELECT value FROM meta WHERE key = 'global_version'").fetchone()
        version = int(version)
        saved = load_file(str(dest / "checkpoints" / f"global-{version:06d}.safetensors"))
        with BackgroundCoordinator(dest, cfg) as restored:  # it verifies the files' digests as it loads them
            assert restored.service.version == version
            weights = restored.service.inspect().weights
            assert weights.keys() == saved.keys() and all(torch.equal(weights[n], saved[n]) for n in saved)
        versions.append(version)
    assert versions == sorted(versions) and versions[0] >= 1
    not_state = subprocess.run([*script, str(tmp_path), str(tmp_path / "x")], capture_output=True, text=True)
    assert not_state.returncode == 1 and "not a coordinator's state directory" in not_state.stderr


def test_a_checkpoint_written_while_it_is_copied_is_copied_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What the live backup guards against, made to happen: the coordinator writes a newer
    version into a file as it is copied (a kept file reused). The copy is made again; a file
    that never holds still fails the backup with one line, and leaves nothing half-copied."""
    spec = importlib.util.spec_from_file_location("backup_state", DEPLOY / "backup_state.py")
    assert spec is not None and spec.loader is not None
    backup_state = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backup_state)
    cfg = tiny_config(rounds=2, train={"sync_every": 1}, outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, Small())) as c:
        TinyParticipant(c.url, "site", Regression(rows=4, seed=0)).run()
    newest = tmp_path / "state" / "checkpoints" / "global-000002.safetensors"
    good = newest.read_bytes()
    copies: list[str] = []
    real_copy = shutil.copyfile

    def copy_then_write(src: Path, dst: Path) -> None:
        real_copy(src, dst)
        copies.append(Path(src).name)
        if Path(src) == newest and (copies.count(newest.name) == 1 or always):
            time.sleep(0.01)  # a modification time of its own, on any file system
            newest.write_bytes(good)  # rewritten in place: the same inode, a new modification time

    monkeypatch.setattr(backup_state.shutil, "copyfile", copy_then_write)
    always = False
    version, copied = backup_state.backup(tmp_path / "state", tmp_path / "b1")
    assert version == 2 and copies.count(newest.name) == 2 and f"checkpoints/{newest.name}" in copied
    always = True
    with pytest.raises(backup_state.BackupError, match="kept changing"):
        backup_state.backup(tmp_path / "state", tmp_path / "b2")
    assert not (tmp_path / "b2" / "checkpoints" / newest.name).exists()
