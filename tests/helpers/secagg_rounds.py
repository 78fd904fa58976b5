"""Securely aggregated rounds that the secure-aggregation test modules share: the three sites
a, b, c (token claims 100, 100, 200) in a 2^16 ring, their random Δs, a round driven over the
HTTP API from the joins to the commit (`helpers/secagg.py`'s `Site`), the plain round to
compare it with, a loopback run trained to the end, and real participant engines in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from fedtrain.participant.engine.sync import SyncEngine
from tests.helpers.api import client, put, wait_round
from tests.helpers.config import ATOKEN, PTOKEN
from tests.helpers.runs import heldout_loss, train_all
from tests.helpers.secagg import Site, ok, run_to_upload

N_MAX = 4  # a 2^16 ring with p = 16 - 1 - 2 = 13 bits: a unit of R / 8191
RANGE = 0.5
SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": N_MAX, "secagg_range": RANGE}
TOKENS = {"a": 100, "b": 100, "c": 200}

Deltas = dict[str, dict[str, torch.Tensor]]


def unit() -> float:
    """One step of the fixed-point ring (RANGE / 8191): each masked contribution is off by at most half of it."""
    return RANGE / (2**13 - 1)


def weights_now(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    """A copy of the global weights as they are now."""
    return {n: t.clone() for n, t in c.service.inspect().weights.items()}


def random_deltas(weights: dict[str, torch.Tensor], seed: int, names: list[str] | None = None) -> Deltas:
    """Each site's Δ: uniform in [-0.2, 0.2) over `names` (default: every tensor), drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return {pid: {n: (torch.rand(weights[n].shape, generator=g) - 0.5) * 0.4 for n in names or weights}
            for pid in TOKENS}


def wait_version(c: BackgroundCoordinator, v: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while c.service.inspect().committed_version < v:
        assert time.monotonic() < deadline, c.service.status()["reason"]
        time.sleep(0.02)


def wait_phase(c: BackgroundCoordinator, phase: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while c.service.status()["secure_aggregation"]["phase"] != phase:
        assert time.monotonic() < deadline, c.service.status()["reason"]
        time.sleep(0.02)


def join_all(http: httpx.Client) -> list[dict[str, Any]]:
    """Every site joins; their join answers."""
    return [ok(http.post("/v1/join", json={"name": pid})) for pid in TOKENS]


def sites_at_upload(http: httpx.Client) -> list[Site]:
    """Every (joined) site through the keys and shares phases, each with its mailbox read."""
    sites = [Site(http, pid) for pid in TOKENS]
    run_to_upload(sites, TOKENS)
    return sites


def upload_masked(sites: list[Site], ds: Deltas) -> None:
    for s in sites:
        ok(s.upload(s.masked(ds[s.pid]), TOKENS[s.pid]))


def reveal_and_commit(c: BackgroundCoordinator, sites: list[Site]) -> None:
    """The round closed: the survivors `sites` reveal, then round 0 commits (version 1)."""
    wait_phase(c, "reveal")
    for s in sites:
        ok(s.reveal())
    wait_version(c, 1)


def plain_round(state: Path, cfg: RunConfig, ds: Deltas) -> dict[str, torch.Tensor]:
    """What a plain run of `cfg` (no secure aggregation) commits in round 0 from the sites' `ds`."""
    with BackgroundCoordinator(state, cfg) as c, client(c, ATOKEN) as http:
        join_all(http)
        for pid, tok in TOKENS.items():
            assert put(http, 0, pid, ds[pid], tokens=tok).status_code == 200
        assert wait_round(http, 0)["state"] == "closed"
        return c.service.inspect().weights


@dataclass
class Trained:
    """A loopback run trained to its end: the held-out loss before, the weights, status and rounds after."""

    initial_loss: float
    final: dict[str, torch.Tensor]
    status: dict[str, Any]
    history: list[dict[str, Any]]

    @property
    def final_loss(self) -> float:
        return heldout_loss(self.final)


def train_loopback(state: Path, cfg: RunConfig, n: int = 2) -> Trained:
    """n recipe participants (`runs.train_all`) against a coordinator of `cfg`, until the run finishes."""
    with BackgroundCoordinator(state, cfg) as c:
        initial = heldout_loss(c.service.inspect().weights)
        train_all(c.url, n)
        return Trained(initial, weights_now(c), c.service.status(), c.service.round_history(10))


class EngineSites:
    """One thread a site, each a real participant engine: it joins (the sites wait for each other,
    since the keys phase waits for every active participant), loads the global model and runs
    `work(pid, engine, params)`. `join` reports what any thread raised."""

    def __init__(self, c: BackgroundCoordinator, before: dict[str, torch.Tensor],
                 work: Callable[[str, SyncEngine, dict[str, torch.Tensor]], None],
                 on_error: Callable[[], None] | None = None) -> None:
        self._url, self._before, self._work, self._on_error = c.url, before, work, on_error
        self._joined_all = threading.Barrier(len(TOKENS), timeout=30)
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._site, args=(pid,)) for pid in TOKENS]

    def _site(self, pid: str) -> None:
        try:
            with CoordinatorClient(self._url, PTOKEN) as cl:
                joined = cl.join(pid)
                self._joined_all.wait()
                params = {n: t.clone() for n, t in self._before.items()}
                engine = SyncEngine(cl, params, who=pid)
                engine.prepare(joined["model"])
                engine.load_global(pid)
                self._work(pid, engine, params)
        except BaseException as e:  # reported by the test thread
            self.errors.append(e)
            if self._on_error is not None:
                self._on_error()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float = 60) -> None:
        for t in self._threads:
            t.join(timeout)
        assert not self.errors, self.errors
