"""One attempt at one round's secure aggregation: who takes part (ids, keys, token claims, weights),
the relayed shares, the masked ring sum and the revealed shares, on top of `SecAggCoordinator`.

An attempt has a random `session`, which every request names: a coordinator that restarted, or a
round whose attempt was refused, has a new session and fresh keys, and a request of the old one is
refused (409 secagg_session) so its participant starts the round's steps again. What an attempt
holds is bounded by `secagg_max_participants` n: 64 bytes of keys per participant, one sealed
bundle (`SEALED_BYTES`) per pair of neighbours, one share (`SHARE_BYTES`) per holder and owner,
and the ring sum (the round's tensors in ring elements). Event loop, except `fold` and `aggregate`
(worker threads, which touch only the ring sum).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedtrain.coordinator.secagg.phases import Phase, SecAggRefused, setup_for
from fedtrain.errors import Refused, WireError
from fedtrain.privacy.coordinator_round import SecAggCoordinator
from fedtrain.privacy.failures import NotEnoughShares, PrivacyError
from fedtrain.privacy.keys import KeyDirectory, PublicKeys
from fedtrain.privacy.round_setup import SECAGG_META, RoundSetup, setup_json
from fedtrain.privacy.unmask import RevealedShare
from fedtrain.wire import TensorSpec

#: Threads that draw the masks to remove at the close (`SecAggCoordinator.finish`): ChaCha20 and
#: numpy release the GIL on large buffers, so a coordinator with free cores unmasks faster.
UNMASK_WORKERS = max(1, min(8, os.cpu_count() or 1))


def conflict(code: str, message: str, **details: Any) -> Refused:
    return Refused(409, code, message, details)


class Attempt:
    """One session of one round: its phase and everything the protocol holds."""

    def __init__(self, round_: int, run: str, privacy: Any, shapes: Mapping[str, tuple[int, ...]], now: float,
                 weigh: Callable[[dict[str, int]], dict[str, float]]) -> None:
        self.round = round_
        self.session = secrets.token_hex(8)
        self.phase: Phase = "keys"
        self.since: float | None = None  # when the phase's clock started (keys: the first advertisement)
        self.opened_at = now
        self.reason = "keys: waiting for the participants' public keys"
        self._run, self._p, self._weigh = run, privacy, weigh
        self._shapes = {n: tuple(s) for n, s in shapes.items()}
        self._ids: dict[str, int] = {}  # participant -> its id in this attempt (1, 2, ...)
        self._keys = KeyDirectory()
        self._claims: dict[int, int] = {}  # id -> tokens counted (public), with the keys or in the claims phase
        self._first_claim_at: float | None = None  # the claims phase's clock: the first participant done training
        self._graph_seed = secrets.token_bytes(16)
        self.setup: RoundSetup | None = None  # fixed when the keys phase closes
        self.protocol: SecAggCoordinator | None = None
        self.weights: dict[int, float] = {}  # fixed when the claims phase closes: who may upload, and with what
        self._revealed: set[int] = set()
        self._fold_lock = threading.Lock()

    # -- reading -----------------------------------------------------------------------------

    def id_of(self, pid: str) -> int | None:
        return self._ids.get(pid)

    def pids(self, ids: set[int] | frozenset[int]) -> set[str]:
        return {pid for pid, i in self._ids.items() if i in ids}

    def advertised(self) -> set[str]:
        return self.pids(set(self._keys.participants()))

    def sharing(self) -> set[str]:
        return self.pids(self.protocol.sharing()) if self.protocol is not None else set()

    def uploaded(self) -> set[str]:
        return self.pids(self.protocol.unmask_request()[0]) if self.protocol is not None else set()

    def revealed(self) -> set[str]:
        return self.pids(self._revealed)

    def claim(self, pid: str) -> int | None:
        i = self._ids.get(pid)
        return self._claims.get(i) if i is not None else None

    def claimed(self) -> set[str]:
        return self.pids(set(self._claims))

    def view(self, pid: str | None) -> dict[str, Any]:
        """What GET /v1/rounds/{r}/secagg answers: the phase and, from `shares` on, the setup."""
        return {"round": self.round, "session": self.session, "phase": self.phase, "reason": self.reason,
                "id": self._ids.get(pid) if pid is not None else None,
                "participants": len(self._ids),
                "setup": setup_json(self.setup) if self.setup is not None else None,
                "weights": {str(i): w for i, w in self.weights.items()} or None}

    def check(self, session: str, *phases: Phase) -> None:
        if session != self.session:
            raise conflict("secagg_session", f"round {self.round}'s secure aggregation is session {self.session}, "
                           f"not {session!r} (the coordinator restarted, or the attempt was refused): start the "
                           "round's steps again", session=self.session)
        if self.phase not in phases:
            raise conflict("secagg_phase", f"round {self.round}'s secure aggregation is in its {self.phase} phase, "
                           f"not {' or '.join(phases)}", phase=self.phase)

    def _member(self, pid: str) -> int:
        i = self._ids.get(pid)
        if i is None:
            raise conflict("secagg_not_member", f"{pid} takes no part in round {self.round}'s secure aggregation "
                           "(it asked for an id after the keys phase closed)", phase=self.phase)
        return i

    # -- keys ----------------------------------------------------------------------------------

    def enrol(self, pid: str) -> int | None:
        """`pid`'s id in this attempt: given in the keys phase (at most n_max), None after it."""
        if pid in self._ids or self.phase != "keys":
            return self._ids.get(pid)
        if len(self._ids) >= self._p.secagg_max_participants:
            raise conflict("secagg_full", f"round {self.round}'s secure aggregation has its "
                           f"{self._p.secagg_max_participants} participants (privacy.secagg_max_participants)")
        self._ids[pid] = len(self._ids) + 1
        return self._ids[pid]

    def advertise(self, pid: str, keys: PublicKeys, tokens: int | None, now: float) -> int:
        """Keys, and the token claim if the participant has trained already (None: it claims in the
        claims phase, having drawn its masks during its inner steps)."""
        i = self._member(pid)
        try:
            self._keys.add(i, keys)
        except PrivacyError as e:
            raise conflict("secagg_keys", e.args[0]) from None
        if tokens is not None:
            self._claim(i, tokens, now)
        if self.since is None:
            self.since = now
        return i

    def close_keys(self, now: float) -> None:
        """U0 is fixed: the setup (t from n) and the pairing graph."""
        ids = self._keys.participants()
        self.setup = setup_for(self._run, self.session, self.round, len(ids), self._p, self._graph_seed)
        self.protocol = SecAggCoordinator(self.setup, self._shapes)
        for i in ids:
            self.protocol.advertise(i, self._keys.get(i))
        self.protocol.directory()  # closes advertisement
        self._enter("shares", now)

    def directory(self, pid: str) -> dict[str, Any]:
        self._member(pid)
        if self.protocol is None:
            raise conflict("secagg_phase", f"round {self.round}'s keys phase is still open", phase=self.phase)
        keys = self.protocol.directory()
        return {"session": self.session, "keys": {str(i): k.to_json() for i, k in keys.items()},
                "weights": {str(i): w for i, w in self.weights.items()},  # (empty until the claims phase closes)
                "tokens": {str(i): self._claims[i] for i in keys if i in self._claims},
                "neighbours": sorted(self.protocol.graph().get(self._ids[pid], ()))}

    # -- shares ----------------------------------------------------------------------------------

    def post_shares(self, pid: str, sealed: Mapping[int, bytes]) -> None:
        i = self._member(pid)
        assert self.protocol is not None
        try:
            self.protocol.post_shares(i, sealed)
        except PrivacyError as e:
            raise Refused(400 if i not in self.protocol.sharing() else 409, "secagg_shares", e.args[0]) from None

    def close_shares(self, now: float) -> None:
        """U1 is fixed. The claims phase's clock started with the first claim (made with the keys or
        after): once one participant has trained, the others have the phase's time to finish, as
        the keys phase gave them when every claim came with the keys."""
        self._enter("claims", now)
        self.since = self._first_claim_at

    # -- claims ----------------------------------------------------------------------------------

    def post_claim(self, pid: str, tokens: int, now: float) -> None:
        """A claim not made with the keys (once; a participant that shared only)."""
        i = self._member(pid)
        assert self.protocol is not None
        if i not in self.protocol.sharing():
            raise conflict("secagg_not_member", f"{pid} posted no shares in round {self.round}: it cannot claim")
        if i in self._claims:
            raise conflict("secagg_claim", f"{pid} already claimed {self._claims[i]} tokens in round {self.round}")
        self._claim(i, tokens, now)
        if self.since is None:
            self.since = now

    def _claim(self, i: int, tokens: int, now: float) -> None:
        self._claims[i] = tokens
        if self._first_claim_at is None:
            self._first_claim_at = now

    def close_claims(self, now: float) -> None:
        """The public weights: the shares of the claims of U1 (capped as the round's weights are).
        A participant of U1 without a claim takes no part in the upload: it counts as dropped."""
        assert self.protocol is not None
        claims = {str(i): self._claims[i] for i in self.protocol.sharing() if i in self._claims}
        self.weights = {int(k): w for k, w in self._weigh(claims).items()}
        self._enter("upload", now)

    def mailbox(self, pid: str) -> dict[str, Any]:
        i = self._member(pid)
        assert self.protocol is not None
        if i not in self.protocol.sharing():
            raise conflict("secagg_not_member", f"{pid} posted no shares in round {self.round}: it cannot mask")
        return {"session": self.session, "sharing": sorted(self.protocol.sharing()),
                "mail": {str(s): b.hex() for s, b in self.protocol.mailbox(i).items()}}

    # -- upload -----------------------------------------------------------------------------------

    def admit(self, pid: str, tokens: int) -> None:
        """Refuse (before a byte is read) a masked upload that cannot count in this attempt."""
        i = self._member(pid)
        if self.phase != "upload":
            raise conflict("secagg_phase", f"round {self.round}'s secure aggregation takes masked uploads in its "
                           f"upload phase, not its {self.phase} phase", phase=self.phase)
        assert self.protocol is not None
        if i not in self.protocol.sharing():
            raise conflict("secagg_not_member", f"{pid} posted no shares in round {self.round}: its masks could "
                           "not be removed")
        if i not in self.weights:
            raise conflict("secagg_not_member", f"{pid} made no token claim before round {self.round}'s claims "
                           "phase closed: it has no weight")
        if tokens != self._claims[i]:
            raise Refused(400, "secagg_tokens", f"the upload claims {tokens} tokens, its claim {self._claims[i]}: "
                          "the weights were fixed from the claims")

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes of the tensors this attempt's masked updates hold (flat)."""
        return dict(self._shapes)

    def check_session_meta(self, metadata: dict[str, str]) -> None:
        """A masked body's (or piece's) metadata names this attempt's session."""
        try:
            about = json.loads(metadata[SECAGG_META])
        except (KeyError, ValueError):
            raise WireError(f"round {self.round} takes masked updates only (secure aggregation): metadata "
                            f"{SECAGG_META} must be JSON {{session, bits}}") from None
        if not isinstance(about, dict) or about.get("session") != self.session:
            raise WireError(f"the masked body is not of round {self.round}'s session {self.session}")

    def check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        """A masked body: the round's tensors, flat, in the ring's unsigned dtype, for this session."""
        assert self.setup is not None
        want = torch.uint16 if self.setup.fixed_point.bits == 16 else torch.uint32
        self.check_session_meta(metadata)
        if set(specs) != set(self._shapes):
            raise WireError(f"a masked update holds the round's {len(self._shapes)} tensors, got {len(specs)}")
        for name, spec in specs.items():
            numel = int(np.prod(self._shapes[name]))
            if spec.dtype != want or spec.shape != (numel,):
                raise WireError(f"masked tensor {name!r} must be {numel} {str(want).removeprefix('torch.')} ring "
                                f"values (flat), got {spec.dtype} {list(spec.shape)}")

    def fold(self, pid: str, path: Path) -> None:
        """Worker thread: add a verified masked body (a spool file) into the ring sum."""
        from safetensors import safe_open

        assert self.protocol is not None
        # one fold at a time: numpy adds large arrays without the GIL, and two uploads adding into
        # one accumulator at once would lose values
        with self._fold_lock, safe_open(str(path), framework="np") as f:
            names = list(f.keys())
            self.protocol.add_upload(self._ids[pid], ((n, f.get_tensor(n)) for n in names))

    # -- reveal ------------------------------------------------------------------------------------

    def close_upload(self, now: float) -> None:
        self._enter("reveal", now)

    def unmask_request(self, pid: str) -> dict[str, Any]:
        self._member(pid)
        assert self.protocol is not None
        alive, dropped = self.protocol.unmask_request()
        return {"session": self.session, "survivors": sorted(alive), "dropped": sorted(dropped)}

    def post_reveal(self, pid: str, shares: list[RevealedShare]) -> None:
        i = self._member(pid)
        assert self.protocol is not None
        if i not in self.protocol.unmask_request()[0]:
            raise conflict("secagg_not_member", f"{pid} has no masked upload in round {self.round}: only survivors "
                           "reveal")
        alive, dropped = self.protocol.unmask_request()
        graph = self.protocol.graph()
        for r in shares:  # (the share's x is the poster's id: the route sets it)
            wanted = "seed" if r.owner in alive else "key" if r.owner in dropped else None
            if r.kind != wanted or r.share.x != i or not (r.owner == i or i in graph.get(r.owner, ())):
                raise Refused(400, "secagg_reveal", f"{pid} may not reveal a {r.kind} share of {r.owner}: survivors' "
                              "seeds and dropped participants' keys, of its own neighbours, only")
        try:
            self.protocol.post_reveal(i, shares)
        except PrivacyError as e:
            raise conflict("secagg_reveal", e.args[0]) from None
        self._revealed.add(i)

    def aggregate(self, workers: int = UNMASK_WORKERS) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Worker thread: the survivors' token-weighted mean and their shares of it, or SecAggRefused."""
        assert self.protocol is not None
        alive, _ = self.protocol.unmask_request()
        try:
            mean = dict(self.protocol.finish(self.weights, workers))
        except (NotEnoughShares, PrivacyError) as e:
            raise SecAggRefused(f"round {self.round}'s secure aggregation could not unmask its sum: {e}") from None
        total = sum(self.weights[i] for i in alive)
        return mean, {pid: self.weights[i] / total for pid, i in self._ids.items() if i in alive}

    def _enter(self, phase: Phase, now: float) -> None:
        self.phase, self.since = phase, now
