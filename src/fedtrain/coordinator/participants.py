"""Participants: joining, heartbeats, leaving and metrics, and the admin's evictions and tokens.

A part (mixin) of `Coordinator` (`service.py`). What each participant last reported is
kept in memory only (`Live`); its row, with its state and the hash of its participant key,
is in the store.

Each participant acts only as itself (`auth.py` says how, and decides the joins): a join
answers with the participant's key, and `act_as` is the check every route that speaks
for a participant makes before it calls the service.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import (
    Holder,
    Identity,
    fingerprint,
    join_rule,
    key_hash,
    key_matches,
    new_participant_key,
    within_cap,
)
from fedtrain.coordinator.base import CoordinatorBase, Live, Refused
from fedtrain.coordinator.store import ParticipantRow
from fedtrain.wire import DTYPE_TO_ST

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ParticipantsMixin(CoordinatorBase):
    """The coordinator's operations on participants and their tokens."""

    def join(self, ident: Identity, name: str | None, info: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        """Join as `name` (a new one when None), presenting the participant key of an earlier
        join (`key`) or not; the answer carries the key to present from now on."""
        if name is None:
            name = f"p-{len(self.participants) + 1}-{int(self.clock() * 1000) % 100000:05d}"
        if not _NAME_RE.match(name):
            raise Refused(
                400, "invalid_name", f"participant name {name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        now = self.clock()
        p = self.participants.get(name)
        if p is not None and p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(409, "name_taken", f"participant name {name!r} is taken by a holder of another token")
        if p is not None and p.state == policy.EVICTED:
            raise Refused(403, "evicted", f"participant {name!r} was evicted from this run by an admin")
        base = self.store.get_meta("base_fingerprint")
        if base is not None and info.get("base") is not None and info["base"] != base:
            # LoRA adapters trained on another base would be merged as if they fit this one.
            raise Refused(
                409, "base_mismatch",
                f"participant {name!r} has a different frozen base model than the run "
                f"(fingerprint {str(info['base'])[:12]}, the run's {base[:12]}): load the run's base weights",
            )
        key_ok = p is not None and key_matches(key, p.key_hash)
        claim = self._claim(ident, name, p, key_ok, now)
        issued = key if claim == "rejoin" and key is not None else new_participant_key()
        if p is None:
            p = ParticipantRow(name, name, ident.token_id, policy.ACTIVE, now, now, self.version, 0, 0, 0, info)
            self._event("join", f"{name} joined at round {self.version}", name)
        else:
            was = p.state
            p.state, p.last_seen, p.info = policy.ACTIVE, now, info or p.info
            how = "" if claim == "rejoin" else "; a new participant key replaces the old one"
            self._event("join", f"{name} rejoined at round {self.version} (was {was}){how}", name)
        p.key_hash, p.proven = key_hash(issued), True
        self.participants[name] = p
        self.live.setdefault(name, Live())
        self.store.upsert_participant(p)
        self._notify()
        return {
            "participant_id": name,
            "participant_key": issued,
            "run": self.config.name,
            "config": self.config.model_dump(mode="json"),
            "config_version": self.config_version,
            "current_round": self.version,
            "finished": self.finished,
            "model": self.model_spec(),
        }

    def _claim(self, ident: Identity, name: str, p: ParticipantRow | None, key_ok: bool, now: float) -> str:
        """How a join takes `name` (`auth.join_rule`: new, rejoin, take_over), or its refusal.
        The admin's joins are not ruled: it acts for anyone."""
        if ident.is_admin:
            return "rejoin" if key_ok else ("new" if p is None else "take_over")
        held = [_holder(q) for q in self.participants.values() if q.token_id == ident.token_id]
        claim = join_rule(name, _holder(p) if p is not None else None, held, key_ok=key_ok, now=now, cfg=self.config)
        if claim.action == "refuse":
            details = {"retry_after_s": round(claim.retry_after_s, 1)} if claim.retry_after_s is not None else None
            raise Refused(claim.status, claim.code, claim.reason, details)
        return claim.action

    def act_as(self, ident: Identity, pid: str, key: str | None) -> ParticipantRow:
        """The check of every request that speaks for participant `pid`: its token (as before),
        then its participant key; the admin token acts for anyone. Raises Refused (404 for no
        such participant, 403 for another's, or no, key)."""
        p = self._participant(ident, pid)
        if ident.is_admin or p.key_hash is None:  # None: it joined before keys existed, and has none to show
            return p
        if not key_matches(key, p.key_hash):
            what = "carries another participant key" if key else "carries no participant key"
            raise Refused(
                403, "not_this_participant",
                f"this request {what} for participant {pid!r}: a participant acts only as itself, with the "
                "participant_key of its join answer (the X-Fedtrain-Participant-Key header)",
            )
        p.proven = True
        return p

    def heartbeat(self, ident: Identity, pid: str, stats: dict[str, Any]) -> dict[str, Any]:
        p = self._participant(ident, pid)
        if p.state == policy.FAILED and not ident.is_admin:  # back to active: within its token's cap
            held = [_holder(q) for q in self.participants.values() if q.token_id == p.token_id]
            refused = within_cap(held, pid, self.config)
            if refused is not None:
                raise Refused(refused.status, refused.code, refused.reason)
        p.last_seen = self.clock()
        if p.state == policy.FAILED:
            p.state = policy.ACTIVE
            self._event("recover", f"{pid} is back after a heartbeat timeout", pid)
            self._notify()
        live = self.live.setdefault(pid, Live())
        live.step = int(stats.get("step", live.step))
        live.loss = stats.get("loss", live.loss)
        live.tokens_per_s = stats.get("tokens_per_s", live.tokens_per_s)
        live.round = int(stats.get("round", live.round))
        if stats.get("config_version") is not None:  # versions only grow: a late heartbeat cannot undo an ack
            p.config_version = max(int(stats["config_version"]), p.config_version or 0)
        self.store.upsert_participant(p)
        return {
            "current_round": self.version,
            "finished": self.finished,
            "state": p.state,
            "config_version": self.config_version,
        }

    def leave(self, ident: Identity, pid: str) -> dict[str, Any]:
        p = self._participant(ident, pid)
        p.state = policy.LEFT
        self.store.upsert_participant(p)
        self._abort_direct(pid)
        self._event("leave", f"{pid} left", pid)
        self._maybe_close()
        self._notify()
        return {"left": True}

    def add_metrics(
        self, ident: Identity, pid: str, round_: int | None, step: int | None, values: dict[str, float]
    ) -> None:
        self._participant(ident, pid)
        self.store.add_metrics(pid, round_, step, values)
        now = time.time()  # the dashboard's charts follow this event (rows shaped like GET /v1/metrics)
        self.broadcast.publish("metrics", [{"ts": now, "participant_id": pid, "round": round_, "step": step,
                                            "name": k, "value": v} for k, v in values.items()])

    def model_spec(self) -> dict[str, dict[str, Any]]:
        return {n: {"dtype": DTYPE_TO_ST[d], "shape": list(s)} for n, (d, s) in self.spec.items()}

    # -- admin: evictions and tokens --------------------------------------------------------

    def evict(self, ident: Identity, pid: str) -> dict[str, Any]:
        """Admin: remove a participant from the run; it may not rejoin under that name."""
        self._require_admin(ident, "evicting a participant")
        p = self._participant(ident, pid)
        p.state, p.evicted_at = policy.EVICTED, self.clock()
        self.store.upsert_participant(p)
        self._event("evict", f"{pid} evicted by an admin; its token may not add participants for "
                             f"{self.config.eviction_cooldown_s:g}s (eviction_cooldown_s)", pid)
        self._maybe_close()
        self._notify()
        return {"evicted": pid}

    def token_view(self, ident: Identity) -> dict[str, Any]:
        """Admin: the participant tokens by fingerprint, whether revoked, who joined with each."""
        self._require_admin(ident, "listing tokens")
        admin_id = fingerprint(self.tokens.admin) if self.tokens.admin else None
        ids = {fingerprint(t) for t in self.tokens.participant} | {p.token_id for p in self.participants.values()}
        ids |= self.tokens.revoked
        ids.discard(admin_id)  # type: ignore[arg-type]
        return {
            "tokens": [
                {
                    "token_id": t,
                    "revoked": t in self.tokens.revoked,
                    "participants": sorted(p.id for p in self.participants.values() if p.token_id == t),
                }
                for t in sorted(ids)
            ]
        }

    def revoke_token(self, ident: Identity, token_id: str | None, participant_id: str | None) -> dict[str, Any]:
        """Admin: refuse a participant token from now on (kept across restarts); its participants are evicted."""
        self._require_admin(ident, "revoking a token")
        if (token_id is None) == (participant_id is None):
            raise Refused(400, "invalid_request", "give exactly one of token_id or participant_id")
        if participant_id is not None:
            token_id = self._participant(ident, participant_id).token_id
        assert token_id is not None
        if self.tokens.admin and token_id == fingerprint(self.tokens.admin):
            raise Refused(400, "admin_token", "the admin token cannot be revoked; restart with another --admin-token")
        if token_id not in {t["token_id"] for t in self.token_view(ident)["tokens"]}:
            raise Refused(404, "unknown_token", f"no participant token has the fingerprint {token_id!r}")
        self.tokens.revoked.add(token_id)
        self.store.set_meta("revoked_tokens", json.dumps(sorted(self.tokens.revoked)))
        evicted = []
        for p in self.participants.values():
            if p.token_id == token_id and p.state != policy.EVICTED:
                p.state, p.evicted_at = policy.EVICTED, self.clock()
                self.store.upsert_participant(p)
                evicted.append(p.id)
        self._event("revoke", f"token {token_id} revoked by an admin; evicted: {', '.join(evicted) or 'none'}")
        self._maybe_close()
        self._notify()
        return {"revoked": token_id, "evicted": evicted}


def _holder(p: ParticipantRow) -> Holder:
    return Holder(p.id, p.state, p.last_seen, keyed=p.key_hash is not None, proven=p.proven, evicted_at=p.evicted_at)
