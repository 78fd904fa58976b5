"""A participant of a securely aggregated round, driven step by step over the HTTP API (the admin's
client acts for anyone): enrol, advertise keys, share, mask and upload, reveal."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import httpx
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.privacy.keys import ParticipantKeys, PublicKeys
from fedtrain.privacy.participant_round import SecAggParticipant
from fedtrain.privacy.round_setup import SECAGG_META, setup_from_json
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from fedtrain.wire.format import ROWS_META

#: One masked piece: its tensors (flat ring values) and each one's element range [lo, hi).
Piece = tuple[dict[str, torch.Tensor], dict[str, list[int]]]


def body_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[bytes, str]:
    enc = EncodedBody(tensors, meta)
    return b"".join(bytes(c) for c in enc), enc.digest()


class Site:
    """One participant `pid` in round `r`."""

    def __init__(self, http: httpx.Client, pid: str, r: int = 0) -> None:
        self.http, self.pid, self.r = http, pid, r
        self.id: int | None = None
        self.session = ""
        self.keys: ParticipantKeys | None = None
        self.sp: SecAggParticipant | None = None
        self.directory: dict[str, Any] = {}
        self.sharing: list[int] = []

    @property
    def base(self) -> str:
        return f"/v1/rounds/{self.r}/secagg"

    def state(self, **params: Any) -> dict[str, Any]:
        r = self.http.get(self.base, params={"participant_id": self.pid, **params})
        assert r.status_code == 200, r.text
        return r.json()

    def enrol(self) -> dict[str, Any]:
        st = self.state()
        self.id, self.session = st["id"], st["session"]
        return st

    def advertise(self, tokens: int | None = 100) -> httpx.Response:
        """Our keys, with our claim (None: claimed later, `claim`)."""
        if self.id is None:
            self.enrol()
        assert self.id is not None
        self.keys = ParticipantKeys.generate(self.id)
        claim = {} if tokens is None else {"tokens": tokens}
        return self.http.post(f"{self.base}/keys/{self.pid}",
                              json={"session": self.session, **self.keys.public().to_json(), **claim})

    def claim(self, tokens: int) -> httpx.Response:
        return self.http.post(f"{self.base}/claim/{self.pid}", json={"session": self.session, "tokens": tokens})

    def share(self) -> httpx.Response:
        st = self.state()
        assert st["phase"] == "shares", st
        assert self.id is not None and self.keys is not None
        self.sp = SecAggParticipant(self.id, setup_from_json(st["setup"]), keys=self.keys)
        d = self.http.get(f"{self.base}/directory/{self.pid}", params={"session": self.session})
        assert d.status_code == 200, d.text
        self.directory = d.json()
        sealed = self.sp.share({int(i): PublicKeys.from_json(k) for i, k in self.directory["keys"].items()})
        return self.http.post(f"{self.base}/shares/{self.pid}",
                              json={"session": self.session, "shares": {str(k): v.hex() for k, v in sealed.items()}})

    def receive(self) -> None:
        m = self.http.get(f"{self.base}/mailbox/{self.pid}", params={"session": self.session})
        assert m.status_code == 200, m.text
        mail = m.json()
        assert self.sp is not None
        self.sp.receive({int(s): bytes.fromhex(b) for s, b in mail["mail"].items()})
        self.sharing = mail["sharing"]

    @property
    def weight(self) -> float:
        """Our public weight (fixed when the claims phase closes: the state shows it from then on)."""
        return float(self.state()["weights"][str(self.id)])

    def masked(self, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.sharing:
            self.receive()
        assert self.sp is not None
        return {n: torch.from_numpy(a) for n, a in self.sp.mask(delta, self.weight, self.sharing).items()}

    def upload(self, tensors: dict[str, torch.Tensor], tokens: int = 100,
               meta: dict[str, str] | None = None) -> httpx.Response:
        meta = meta if meta is not None else {SECAGG_META: json.dumps({"session": self.session, "bits": 16})}
        data, digest = body_bytes(tensors, meta)
        return self.http.put(f"/v1/rounds/{self.r}/updates/{self.pid}", params={"tokens": tokens}, content=data,
                             headers={DIGEST_HEADER: digest})

    def masked_pieces(self, delta: dict[str, torch.Tensor], pieces: int = 2) -> list[Piece]:
        """Δ masked as an FSDP group's ranks mask it: each tensor's flat elements cut into `pieces`
        ranges (off a 64-byte block), each range masked at its offset with the group's seeds."""
        if not self.sharing:
            self.receive()
        assert self.sp is not None
        masks, weight = self.sp.group_masks(self.sharing), self.weight
        out: list[Piece] = [({}, {}) for _ in range(pieces)]
        for name, t in delta.items():
            flat = t.reshape(-1)
            cuts = [0, *sorted({min(flat.numel(), flat.numel() * k // pieces + 3) for k in range(1, pieces)}),
                    flat.numel()]
            for k, (lo, hi) in enumerate(itertools.pairwise(cuts)):
                if hi > lo:
                    out[k][0][name] = torch.from_numpy(masks.mask_rows(name, flat[lo:hi], weight, lo))
                    out[k][1][name] = [lo, hi]
        return out

    def upload_piece(self, label: str, piece: Piece, tokens: int = 100,
                     meta: dict[str, str] | None = None) -> httpx.Response:
        tensors, ranges = piece
        meta = meta if meta is not None else {SECAGG_META: json.dumps({"session": self.session, "bits": 16}),
                                              ROWS_META: json.dumps(ranges)}
        data, digest = body_bytes(tensors, meta)
        return self.http.put(f"/v1/rounds/{self.r}/updates/{self.pid}", params={"tokens": tokens, "piece": label},
                             content=data, headers={DIGEST_HEADER: digest})

    def reveal(self) -> httpx.Response:
        u = self.http.get(f"{self.base}/unmask/{self.pid}", params={"session": self.session})
        assert u.status_code == 200, u.text
        req = u.json()
        assert self.sp is not None
        shares = self.sp.reveal(req["survivors"], req["dropped"])
        return self.http.post(f"{self.base}/reveal/{self.pid}", json={
            "session": self.session,
            "shares": [{"owner": s.owner, "kind": s.kind, "share": s.share.to_bytes().hex()} for s in shares]})


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def run_to_upload(sites: list[Site], tokens: dict[str, int]) -> None:
    """Every site enrols, advertises (the keys phase closes with the last), shares (the shares
    phase closes with the last) and reads its mailbox."""
    for s in sites:
        s.enrol()
    for s in sites:
        ok(s.advertise(tokens[s.pid]))
    for s in sites:
        ok(s.share())
    for s in sites:
        s.receive()


def reveal_and_commit(c: BackgroundCoordinator, sites: list[Site], version: int, within_s: float = 15.0) -> None:
    """Once the round's attempt is in its reveal phase, each of `sites` reveals; then wait until
    the coordinator has committed `version`."""
    deadline = time.monotonic() + within_s
    while c.service.status()["secure_aggregation"]["phase"] != "reveal":
        assert time.monotonic() < deadline, c.service.status()["reason"]
        time.sleep(0.02)
    for s in sites:
        ok(s.reveal())
    while c.service.inspect().committed_version < version:
        assert time.monotonic() < deadline + 10, c.service.status()["reason"]
        time.sleep(0.02)
