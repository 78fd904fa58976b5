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
import json
import os
import re
import shlex
import shutil
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from fedtrain.cli import build_parser
from fedtrain.config import load_config
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import DIGEST_HEADER, EncodedBody, read_tensors
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.nginx import SITE_TEMPLATE, Nginx, nginx_binary
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file, run_all
from tests.helpers.tls import make_tls

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


def sse_events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """The server-sent events of a streamed response, as (kind, data); comments (keep-alives) skipped."""
    kind, data = "message", ""
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line == "" and data:
            yield kind, json.loads(data)
            kind, data = "message", ""


def test_a_run_goes_through_nginx_with_the_shipped_config(tmp_path: Path, nginx: str) -> None:
    ca, cert, key = make_tls(tmp_path / "tls")
    cfg = tiny_config(rounds=2, train={"sync_every": 2}, max_upload_mb=UPLOAD_MB, outer={"algorithm": "fedavg"})
    wide = functools.partial(Small, WIDTH)
    trust = ssl.create_default_context(cafile=str(ca))
    with (
        BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, wide())) as c,
        Nginx(tmp_path / "nginx", upstream=c.url, cert=cert, key=key, max_body=f"{UPLOAD_MB}m") as proxy,
        httpx.Client(base_url=proxy.url, verify=trust, timeout=30, headers={"Authorization": f"Bearer {ATOKEN}"}) as admin,
        httpx.Client(base_url=proxy.url, verify=trust, timeout=30, headers={"Authorization": f"Bearer {PTOKEN}"}) as http,
    ):
        # The dashboard: its page and what the page loads.
        page = admin.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for asset in re.findall(r'(?:src|href)="(static/[^"]+)"', page.text):
            assert admin.get("/" + asset).status_code == 200, asset

        # The event stream stays open through the proxy, and an event arrives on it as it happens:
        # a join made after the stream opened (a buffering proxy would hold it).
        with admin.stream("GET", "/v1/stream", timeout=httpx.Timeout(30, read=STREAM_READ_S)) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            events = sse_events(stream)
            assert next(events)[0] == "hello"
            joined = http.post("/v1/join", json={"name": "probe"})
            assert joined.status_code == 200, joined.text
            kind, data = next(events)
            while "probe" not in json.dumps(data):  # bounded: each read waits STREAM_READ_S at most
                kind, data = next(events)
            # The round's long poll is held through the proxy and answered (nobody submitted: open).
            polled = http.get("/v1/rounds/0", params={"wait": 1, "participant_id": "probe"})
            assert polled.status_code == 200 and polled.json()["state"] == "open", polled.text
            # An upload over the run's limit gets the coordinator's own answer (JSON), not nginx's page.
            over = b"\0" * (UPLOAD_MB * 10**6 + 1000)
            refused = http.put("/v1/rounds/0/updates/probe", params={"tokens": 1}, content=over,
                               headers={DIGEST_HEADER: "xxh3-128:" + "0" * 32})
            assert refused.status_code == 413 and refused.json()["error"]["status"] == 413, refused.text
            assert http.post("/v1/participants/probe/leave").status_code == 200

        # Two real participants over TLS through nginx: join, upload (2 MB each), long poll, download.
        sites = [TinyParticipant(proxy.url, f"site-{i}", Regression(rows=8, seed=i, lr=1e-5, model=wide), verify=str(ca))
                 for i in range(2)]
        run_all(sites, timeout=120)
        assert c.service.version == 2
        final = c.service.inspect().weights
        for site in sites:
            assert site.fed is not None and site.fed.round == 2
            for name, t in final.items():
                assert torch.equal(site.weights[name], t), (site.name, name)
        assert EncodedBody(dict(final)).content_length > 2**20  # more than nginx's default limit

        # A download by hand, checked against the coordinator's weights.
        r = http.get("/v1/model")
        assert r.status_code == 200 and int(r.headers["X-Fedtrain-Version"]) == 2
        got = dict(read_tensors([r.content], expected_digest=r.headers[DIGEST_HEADER]))
        assert got.keys() == final.keys() and all(torch.equal(got[n], t) for n, t in final.items())

    # All of it went through nginx, not around it.
    log = (tmp_path / "nginx" / "access.log").read_text()
    for seen in ("PUT /v1/rounds/0/updates/site-0", "PUT /v1/rounds/1/updates/site-1", "GET /v1/model",
                 "GET /v1/stream", "POST /v1/join", "wait="):
        assert seen in log, seen
