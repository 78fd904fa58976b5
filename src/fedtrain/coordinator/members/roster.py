"""The roster: who takes part in the run, what each last reported, and the admin's
evictions and tokens.

More: docs/architecture.md, "coordinator/members/roster.py".
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fedtrain.config import RunConfig
from fedtrain.coordinator import policy
from fedtrain.coordinator.members import processes
from fedtrain.coordinator.members.auth import (
    Holder,
    Identity,
    Tokens,
    fingerprint,
    join_rule,
    key_hash,
    key_matches,
    new_participant_key,
    require_admin,
    within_cap,
)
from fedtrain.coordinator.members.site_tokens import SiteTokens
from fedtrain.coordinator.policy.balance import Reported
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.store import ParticipantRow, Store
from fedtrain.errors import Refused

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Rows of participants that left, kept at most (the oldest departures beyond it are forgotten).
MAX_DEPARTED = 1000
#: One metrics report: at most this many values, each name at most MAX_METRIC_NAME characters.
MAX_METRIC_VALUES = 1000
MAX_METRIC_NAME = 200


@dataclass
class Live:
    """What a participant last told us; kept in memory only."""

    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None  # its own inner-step rate (balanced rounds); the last one reported
    round: int = 0
    config_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Roster:
    """The run's participants: joins, heartbeats, departures, failures and the admin's
    evictions and token revocations. Every change of a row is written to the store."""

    def __init__(self, store: Store, events: Events, tokens: Tokens, clock: Callable[[], float]) -> None:
        self._store = store
        self._events = events
        self._tokens = tokens
        self._sites = SiteTokens(store, tokens, clock)  # the named participant tokens, loaded from the store
        self._clock = clock
        self._rows: dict[str, ParticipantRow] = {p.id: p for p in store.participants()}
        self._live: dict[str, Live] = {pid: Live() for pid in self._rows}
        self._prune_departed()
        now = clock()
        for p in self._rows.values():
            if p.state == policy.ACTIVE:
                p.last_seen = now  # a grace period to reconnect after a coordinator restart

    # -- reading ----------------------------------------------------------------------------

    @property
    def rows(self) -> dict[str, ParticipantRow]:
        """Every participant by id (read only: change them through the roster's methods)."""
        return self._rows

    @property
    def live(self) -> dict[str, Live]:
        """What each participant last reported (read only)."""
        return self._live

    def views(self) -> list[policy.ParticipantView]:
        """The participants as the policy sees them."""
        return [policy.ParticipantView(p.id, p.state, p.last_seen) for p in self._rows.values()]

    def active(self) -> set[str]:
        return {p.id for p in self._rows.values() if p.state == policy.ACTIVE}

    def reported(self, also: str | None = None) -> dict[str, Reported]:
        """What each active participant (and `also`, whatever its state) last reported about its
        speed (balanced rounds)."""
        out = {}
        for pid in self.active() | ({also} if also in self._rows else set()):
            live, world = self._live.get(pid, Live()), self._rows[pid].info.get("world_size", 1)
            out[pid] = Reported(live.steps_per_s, live.tokens_per_s, world if isinstance(world, int) else 1)
        return out

    def get(self, ident: Identity, pid: str) -> ParticipantRow:
        """Participant `pid`, if `ident` may act on it (its token, or the admin's): else 404 or 403."""
        p = self._rows.get(pid)
        if p is None:
            raise Refused(404, "unknown_participant", f"participant {pid!r} is not part of this run; join first")
        if p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(403, "forbidden", f"participant {pid!r} joined with a different token")
        if p.state == policy.EVICTED and not ident.is_admin:
            raise Refused(403, "evicted", f"participant {pid!r} was evicted from this run by an admin")
        return p

    # -- a participant's own requests ---------------------------------------------------------

    def join(self, ident: Identity, name: str | None, info: dict[str, Any], key: str | None, round_: int,
             cfg: RunConfig) -> tuple[str, str]:
        """Join as `name` (a new one when None) at round `round_`, presenting the participant
        key of an earlier join (`key`) or not. Returns the name and the key to present from now on."""
        with self.joining(ident, name, info, key, round_, cfg) as taken:
            return taken

    @contextmanager
    def joining(self, ident: Identity, name: str | None, info: dict[str, Any], key: str | None, round_: int,
                cfg: RunConfig) -> Iterator[tuple[str, str]]:
        """`join`, for a caller that has more to do before the join is done (build its answer):
        inside the block the participant is in the roster in memory only; it is stored, and its
        join recorded, when the block ends without an error. A join that fails leaves the roster
        as it was: no half-written row whose key nobody was given, which would lock the name
        out (409 name_in_use) until the heartbeat timeout."""
        if name is None:
            name = f"p-{len(self._rows) + 1}-{int(self._clock() * 1000) % 100000:05d}"
        had_live, before = name in self._live, self._rows.get(name)
        snapshot = dataclasses.replace(before) if before is not None else None
        issued, p, message = self._take(ident, name, info, key, round_, cfg)
        try:
            yield name, issued
            self._store.upsert_participant(p)
        except BaseException:
            if snapshot is not None:  # the same object others may hold (an upload in flight): its fields back
                for f in dataclasses.fields(p):
                    setattr(p, f.name, getattr(snapshot, f.name))
            else:
                self._rows.pop(name, None)
            if not had_live:
                self._live.pop(name, None)
            raise
        self._events.record("join", message, name)

    def _take(self, ident: Identity, name: str, info: dict[str, Any], key: str | None, round_: int,
              cfg: RunConfig) -> tuple[str, ParticipantRow, str]:
        """The join's checks and its row, in memory only: (key issued, row, event message)."""
        if not _NAME_RE.match(name):
            raise Refused(
                400, "invalid_name", f"participant name {name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        processes.check_info(info)  # what it says of its processes is shown to everyone: readable, or refused
        now = self._clock()
        p = self._rows.get(name)
        if p is not None and p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(409, "name_taken", f"participant name {name!r} is taken by a holder of another token")
        if p is not None and p.state == policy.EVICTED:
            raise Refused(403, "evicted", f"participant {name!r} was evicted from this run by an admin")
        base = self._store.get_meta("base_fingerprint")
        if base is not None and info.get("base") is not None and info["base"] != base:
            # LoRA adapters trained on another base would be merged as if they fit this one.
            raise Refused(
                409, "base_mismatch",
                f"participant {name!r} has a different frozen base model than the run "
                f"(fingerprint {str(info['base'])[:12]}, the run's {base[:12]}): load the run's base weights",
            )
        key_ok = p is not None and key_matches(key, p.key_hash)
        claim = self._claim(ident, name, p, key_ok, now, cfg)
        issued = key if claim == "rejoin" and key is not None else new_participant_key()
        if p is None:
            p = ParticipantRow(name, name, ident.token_id, policy.ACTIVE, now, now, round_, 0, 0, 0, info)
            message = f"{name} joined at round {round_}"
        else:
            was = p.state
            p.state, p.last_seen, p.info = policy.ACTIVE, now, info or p.info
            how = "" if claim == "rejoin" else "; a new participant key replaces the old one"
            message = f"{name} rejoined at round {round_} (was {was}){how}"
        p.key_hash, p.proven = key_hash(issued), True
        self._rows[name] = p
        self._live.setdefault(name, Live())
        return issued, p, message

    def _claim(self, ident: Identity, name: str, p: ParticipantRow | None, key_ok: bool, now: float,
               cfg: RunConfig) -> str:
        """How a join takes `name` (`auth.join_rule`: new, rejoin, take_over), or its refusal.
        The admin's joins are not ruled: it acts for anyone."""
        if ident.is_admin:
            return "rejoin" if key_ok else ("new" if p is None else "take_over")
        held = [_holder(q) for q in self._rows.values() if q.token_id == ident.token_id]
        claim = join_rule(name, _holder(p) if p is not None else None, held, key_ok=key_ok, now=now, cfg=cfg)
        if claim.action == "refuse":
            details = {"retry_after_s": round(claim.retry_after_s, 1)} if claim.retry_after_s is not None else None
            raise Refused(claim.status, claim.code, claim.reason, details)
        return claim.action

    def act_as(self, ident: Identity, pid: str, key: str | None) -> ParticipantRow:
        """The check of every request that speaks for participant `pid`: its token (as before),
        then its participant key; the admin token acts for anyone. Raises Refused (404 for no
        such participant, 403 for another's, or no, key)."""
        p = self.get(ident, pid)
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

    def heartbeat(self, ident: Identity, pid: str, stats: dict[str, Any],
                  cfg: RunConfig) -> tuple[ParticipantRow, bool]:
        """Note a heartbeat and what it reports; (the row, whether a failed participant came back)."""
        p = self.get(ident, pid)
        if p.state == policy.FAILED and not ident.is_admin:  # back to active: within its token's cap
            held = [_holder(q) for q in self._rows.values() if q.token_id == p.token_id]
            refused = within_cap(held, pid, cfg)
            if refused is not None:
                raise Refused(refused.status, refused.code, refused.reason)
        p.last_seen = self._clock()
        back = p.state == policy.FAILED
        if back:
            p.state = policy.ACTIVE
            self._events.record("recover", f"{pid} is back after a heartbeat timeout", pid)
        live = self._live.setdefault(pid, Live())
        live.step = int(stats.get("step", live.step))
        live.loss = stats.get("loss", live.loss)
        live.tokens_per_s = stats.get("tokens_per_s", live.tokens_per_s)
        if stats.get("steps_per_s") is not None:  # a heartbeat without one (a config ack) keeps the last
            live.steps_per_s = stats["steps_per_s"]
        live.round = int(stats.get("round", live.round))
        if stats.get("config_version") is not None:  # versions only grow: a late heartbeat cannot undo an ack
            p.config_version = max(int(stats["config_version"]), p.config_version or 0)
        self._store.update_participants([p])  # not its info: written once, by its join
        return p, back

    def leave(self, ident: Identity, pid: str) -> None:
        p = self.get(ident, pid)
        p.state = policy.LEFT
        p.info = processes.kept_after_leaving(p.info)  # what the status shows; a rejoin says the rest again
        self._store.upsert_participant(p)
        self._events.record("leave", f"{pid} left", pid)
        self._prune_departed()

    def _prune_departed(self) -> None:
        """Forget the rows of the participants that left longest ago beyond MAX_DEPARTED, so that
        joins and departures under new names cannot grow the roster without end. Evicted and
        failed rows stay (an eviction's cool-down, a failed participant's return)."""
        departed = [p for p in self._rows.values() if p.state == policy.LEFT]
        if len(departed) <= MAX_DEPARTED:
            return
        departed.sort(key=lambda p: p.last_seen)
        gone = [p.id for p in departed[: len(departed) - MAX_DEPARTED]]
        for pid in gone:
            del self._rows[pid]
            self._live.pop(pid, None)
        self._store.forget_participants(gone)

    def add_metrics(self, ident: Identity, pid: str, round_: int | None, step: int | None,
                    values: dict[str, float]) -> None:
        self.get(ident, pid)
        check_metrics(values)
        self._store.add_metrics(pid, round_, step, values)
        now = time.time()  # the dashboard's charts follow this event (rows shaped like GET /v1/metrics)
        self._events.publish("metrics", [{"ts": now, "participant_id": pid, "round": round_, "step": step,
                                          "name": k, "value": v} for k, v in values.items()])

    def counted_upload(self, p: ParticipantRow, round_: int, tokens: int, nbytes: int) -> None:
        """An update of `p` for `round_` was taken: count it (the row is stored by `store_row`)."""
        p.bytes_up = policy.bounded_sum((p.bytes_up, nbytes))  # sums saturate at 2^53 - 1: within SQLite's
        p.tokens = policy.bounded_sum((p.tokens, tokens))  # integers, and exact as floats
        p.round = round_
        p.last_seen = self._clock()

    def store_row(self, p: ParticipantRow) -> None:
        self._store.update_participants([p])

    def counted_download(self, pid: str | None, nbytes: int) -> None:
        if pid is not None and pid in self._rows:
            p = self._rows[pid]
            p.bytes_down = policy.bounded_sum((p.bytes_down, nbytes))

    def fail_silent(self, cfg: RunConfig) -> list[str]:
        """Mark failed the participants silent for too long (`policy.stale_participants`); their ids."""
        failed = []
        for pid, why in policy.stale_participants(self.views(), self._clock(), cfg):
            p = self._rows[pid]
            p.state = policy.FAILED
            self._store.update_participants([p])
            self._events.record("fail", f"{pid} failed: {why}", pid)
            failed.append(pid)
        return failed

    def store_all(self) -> None:
        """Write every row (a participant's downloads since its row was last stored count too)."""
        self._store.update_participants(list(self._rows.values()))

    # -- admin: evictions and tokens --------------------------------------------------------

    def evict(self, ident: Identity, pid: str, cfg: RunConfig) -> None:
        """Admin: remove a participant from the run; it may not rejoin under that name, and its
        token (its site's, when tokens are per site) may not add participants for a while."""
        require_admin(ident, "evicting a participant")
        p = self.get(ident, pid)
        p.state, p.evicted_at = policy.EVICTED, self._clock()
        self._store.update_participants([p])
        self._events.record("evict", f"{pid} evicted by an admin; its token ({self._token_label(p.token_id)}) may "
                                     f"not add participants for {cfg.eviction_cooldown_s:g}s (eviction_cooldown_s); "
                                     "other tokens are not affected", pid)

    def site_of(self, token_id: str) -> str | None:
        """The site a participant token was minted for (None: a token from the command line or env)."""
        row = self._sites.by_id(token_id)
        return row.name if row is not None else None

    def _token_label(self, token_id: str) -> str:
        row = self._sites.by_id(token_id)
        return f"{row.name!r}, {token_id}" if row is not None else token_id

    def token_view(self, ident: Identity) -> dict[str, Any]:
        """Admin: the participant tokens by fingerprint: name (named ones), where each came from,
        whether revoked, who joined with each (`SiteTokens.listing`)."""
        require_admin(ident, "listing tokens")
        admin_id = fingerprint(self._tokens.admin) if self._tokens.admin else None
        given = {fingerprint(t) for t in self._tokens.participant}
        holders: dict[str, list[str]] = {}
        for p in self._rows.values():
            holders.setdefault(p.token_id, []).append(p.id)
        ids = (given | set(holders) | self._tokens.revoked) - {admin_id}
        return {"tokens": self._sites.listing(ids, given, holders)}

    def mint_token(self, ident: Identity, name: str) -> dict[str, Any]:
        """Admin: a new participant token for site `name`; the answer is the one time it is shown."""
        require_admin(ident, "minting a token")
        row, token = self._sites.mint(name)
        self._events.record("token", f"participant token {row.name!r} ({row.token_id}) minted by an admin")
        return {"name": row.name, "token_id": row.token_id, "token": token, "created_at": row.created_at}

    def adopt_tokens(self, name: str, tokens: list[str]) -> list[str]:
        """Keep these tokens (a legacy tokens.json's) as named tokens `name`, `name-2`, ... unless
        they are already; the names of those added."""
        added = [row.name for row in (self._sites.adopt(name, t) for t in tokens) if row is not None]
        if added:
            self._events.record("token", f"participant tokens of tokens.json kept as named tokens: {', '.join(added)}")
        return added

    def named_tokens(self) -> int:
        """How many named participant tokens the run holds (revoked ones too)."""
        return len(self._sites.rows())

    def revoke_token(self, ident: Identity, token_id: str | None, participant_id: str | None,
                     name: str | None = None) -> dict[str, Any]:
        """Admin: refuse a participant token from now on (kept across restarts); its participants
        are evicted. The token is given by its fingerprint, a participant that joined with it,
        or its name (a live named token)."""
        require_admin(ident, "revoking a token")
        if sum(x is not None for x in (token_id, participant_id, name)) != 1:
            raise Refused(400, "invalid_request", "give exactly one of token_id, participant_id or name")
        if participant_id is not None:
            token_id = self.get(ident, participant_id).token_id
        if name is not None:
            row = self._sites.live_named(name)
            if row is None:
                raise Refused(404, "unknown_token", f"no live participant token is named {name!r}")
            token_id = row.token_id
        assert token_id is not None
        if self._tokens.admin and token_id == fingerprint(self._tokens.admin):
            raise Refused(400, "admin_token", "the admin token cannot be revoked; restart with another --admin-token")
        if token_id not in {t["token_id"] for t in self.token_view(ident)["tokens"]}:
            raise Refused(404, "unknown_token", f"no participant token has the fingerprint {token_id!r}")
        self._sites.revoke(token_id)
        self._tokens.revoked.add(token_id)
        self._store.set_meta("revoked_tokens", json.dumps(sorted(self._tokens.revoked)))
        evicted = []
        for p in self._rows.values():
            if p.token_id == token_id and p.state != policy.EVICTED:
                p.state, p.evicted_at = policy.EVICTED, self._clock()
                self._store.update_participants([p])
                evicted.append(p.id)
        self._events.record("revoke", f"token {self._token_label(token_id)} revoked by an admin; evicted: "
                                      f"{', '.join(evicted) or 'none'}")
        return {"revoked": token_id, "evicted": evicted}


def check_metrics(values: dict[str, float]) -> None:
    """Refuse a metrics report larger than its bounds: each is stored and sent to every stream
    subscriber (413 `metrics_too_large`: more than MAX_METRIC_VALUES values; 422
    `invalid_metric_name`: a name longer than MAX_METRIC_NAME)."""
    if len(values) > MAX_METRIC_VALUES:
        raise Refused(413, "metrics_too_large", f"a metrics report holds {len(values):,} values, more than "
                      f"{MAX_METRIC_VALUES:,}: report them in several", {"field": "values"})
    long = next((k for k in values if len(k) > MAX_METRIC_NAME), None)
    if long is not None:
        raise Refused(422, "invalid_metric_name", f"metric name {long[:40]!r}... is {len(long):,} characters long, "
                      f"more than {MAX_METRIC_NAME}", {"field": "values"})


def _holder(p: ParticipantRow) -> Holder:
    return Holder(p.id, p.state, p.last_seen, keyed=p.key_hash is not None, proven=p.proven, evicted_at=p.evicted_at)
