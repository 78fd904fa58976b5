"""Who may act in a run: bearer-token roles, and the credential of each participant.

Tokens are compared in constant time and never logged; a participant is bound to a
fingerprint (a hash prefix) of the token it joined with, never to the token itself.
A participant token can be revoked by its fingerprint (`Tokens.revoked`): from then on
it identifies no one, and the coordinator keeps the revocation across restarts.
Participant tokens are either given at start (flags, environment, a legacy tokens.json:
`Tokens.participant`) or named, one per site, minted at run time (`Tokens.named`, kept as
their sha256 only: `site_tokens.py`).

More: docs/architecture.md, "coordinator/members/auth.py".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fedtrain.config import RunConfig
from fedtrain.coordinator import policy
from fedtrain.coordinator.state.store import TokenRow
from fedtrain.errors import Refused

PARTICIPANT = "participant"
ADMIN = "admin"
ROLE_CHECK_ATTR = "fedtrain_role_check"
KEY_HEADER = "X-Fedtrain-Participant-Key"
KEY_COOKIE_PREFIX = "fedtrain-key-"
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Identity:
    role: str
    token_id: str

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


def role_check(fn: F) -> F:
    """Mark a route dependency as the one that authenticates and authorizes a request; a test
    walks the route table and fails for any mutating route without such a dependency."""
    setattr(fn, ROLE_CHECK_ATTR, True)
    return fn


def token_digest(token: str) -> str:
    """What the store keeps of a named participant token: its sha256 (a minted token has 192
    random bits, so a fast hash is enough, and no salt is needed for a secret nobody chose)."""
    return hashlib.sha256(token.encode()).hexdigest()


def fingerprint(token: str) -> str:
    return token_digest(token)[:12]


@dataclass
class Tokens:
    participant: list[str] = field(default_factory=list)
    admin: str | None = None
    revoked: set[str] = field(default_factory=set)  # fingerprints of revoked participant tokens
    # Named participant tokens by their sha256 (`site_tokens.SiteTokens` owns them: it replaces
    # the dict whole, so a request that reads it meanwhile sees the old one or the new one).
    named: dict[str, TokenRow] = field(default_factory=dict)

    @classmethod
    def from_env(cls, participant: list[str] | None = None, admin: str | None = None) -> Tokens:
        """Tokens given explicitly win; else FEDTRAIN_TOKEN (comma-separated) and FEDTRAIN_ADMIN_TOKEN."""
        if not participant:
            env = os.environ.get("FEDTRAIN_TOKEN", "")
            participant = [t.strip() for t in env.split(",") if t.strip()]
        admin = admin or os.environ.get("FEDTRAIN_ADMIN_TOKEN") or None
        return cls(participant=list(participant), admin=admin)

    @staticmethod
    def generate() -> str:
        """A new random token. URL-safe base64 may start with "-", which a command line takes
        for an option (`--token -x…`: "expected one argument"), so it carries a prefix."""
        return "ft_" + secrets.token_urlsafe(24)

    def identify(self, authorization: str | None) -> Identity | None:
        """The identity behind an `Authorization: Bearer …` header, or None."""
        token = _bearer(authorization)
        if token is None:
            return None
        found: Identity | None = None
        # Compare against every token so that timing says nothing about which one matched.
        if self.admin is not None and hmac.compare_digest(token.encode(), self.admin.encode()):
            found = Identity(ADMIN, fingerprint(token))
        for candidate in self.participant:
            if hmac.compare_digest(token.encode(), candidate.encode()) and found is None:
                found = Identity(PARTICIPANT, fingerprint(token))
        # A named token is found by its sha256: a lookup that learns nothing of the token from timing.
        named = self.named.get(token_digest(token))
        if named is not None and found is None:
            found = Identity(PARTICIPANT, named.token_id)
        if found is not None and not found.is_admin and found.token_id in self.revoked:
            return None
        return found

    def is_revoked(self, authorization: str | None) -> bool:
        """Whether the header carries a participant token that was revoked (for a clearer 401)."""
        token = _bearer(authorization)
        return token is not None and fingerprint(token) in self.revoked

    def refusal(self, authorization: str | None) -> tuple[str, str]:
        """The 401's code and message for a header that `identify` found no one behind: the
        one answer of every way a token arrives (the header, or `?token=` for EventSource)."""
        if self.is_revoked(authorization):
            return "token_revoked", "this token was revoked by the run's admin"
        if not authorization:
            return "unauthorized", "missing bearer token"
        return "unauthorized", "invalid token: not a token of this run"


def _bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


# -- participant keys ---------------------------------------------------------------------------


def new_participant_key() -> str:
    """A new participant key: 256 random bits, URL-safe, with a prefix that says what it is."""
    return "fk_" + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """What the store keeps of a participant key: its sha256 (the key has 256 random bits, so a
    fast hash is enough; no salt is needed for a secret nobody chose)."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str | None, stored: str | None) -> bool:
    """Whether `key` is the one whose hash is `stored`, in constant time."""
    if key is None or stored is None:
        return False
    return hmac.compare_digest(key_hash(key).encode(), stored.encode())


def key_cookie(pid: str) -> str:
    """The name of the cookie that carries participant `pid`'s key."""
    return KEY_COOKIE_PREFIX + pid


@dataclass(frozen=True)
class Holder:
    """A participant as the join rules see it."""

    id: str
    state: str
    last_seen: float
    keyed: bool = True  # it has a key (a participant that joined before keys existed has none)
    proven: bool = False  # heard from with its key since this coordinator process started
    evicted_at: float | None = None


@dataclass(frozen=True)
class Claim:
    """The decision on a join: `new` name, `rejoin` with its key, `take_over` a name without
    it (a new key replaces the old one), or `refuse` with the status and code to answer."""

    action: Literal["new", "rejoin", "take_over", "refuse"]
    reason: str
    status: int = 200
    code: str = ""
    retry_after_s: float | None = None


def _claim_name(name: str, held: Holder | None, key_ok: bool, now: float, cfg: RunConfig) -> Claim:
    """Who may have the name `name` (its holder `held`) when a joiner presents a key (`key_ok`) or not."""
    if held is None:
        return Claim("new", f"{name} is a new participant")
    if held.state == policy.EVICTED:
        return Claim("refuse", f"participant {name!r} was evicted from this run by an admin", 403, "evicted")
    if key_ok:
        return Claim("rejoin", "it presented its participant key")
    silent = now - held.last_seen
    if not held.keyed:
        return Claim("take_over", "it joined before participants had keys")
    if held.state in (policy.FAILED, policy.LEFT):
        return Claim("take_over", f"it had {held.state}; its old key no longer acts")
    if silent > cfg.heartbeat_timeout_s:
        return Claim("take_over", f"it was silent for {silent:.0f}s (heartbeat_timeout_s {cfg.heartbeat_timeout_s:g})")
    if not held.proven:
        return Claim("take_over", "it had not been heard from with its key since the coordinator started")
    rest = cfg.heartbeat_timeout_s - silent
    return Claim(
        "refuse",
        f"participant name {name!r} is in use: its holder is active (heard from {silent:.0f}s ago) and this "
        "join does not carry its participant key; a participant acts only as itself. If it is this participant, "
        f"restarted without its key, the name is free once the old one fails by heartbeat timeout in {rest:.0f}s",
        409, "name_in_use", retry_after_s=max(rest, 0.0),
    )


def within_cap(token_holders: Sequence[Holder], name: str, cfg: RunConfig) -> Claim | None:
    """None when participant `name` may become active under its token, whose participants are
    `token_holders`; else the refusal: the token already holds `max_participants_per_token`
    active participants besides it."""
    active = [h.id for h in token_holders if h.state == policy.ACTIVE and h.id != name]
    cap = cfg.max_participants_per_token
    if len(active) < cap:
        return None
    return Claim(
        "refuse",
        f"this token already has {len(active)} active participants, the most max_participants_per_token ({cap}) "
        f"allows: {name!r} cannot join until one of them leaves or fails (ask the run's admin for a token of its "
        "own, or to raise the cap)",
        403, "too_many_participants",
    )


def _cooled_down(token_holders: Sequence[Holder], now: float, cfg: RunConfig) -> Claim | None:
    """None when the token may take a new key; else the refusal: one of its participants was
    evicted less than `eviction_cooldown_s` ago."""
    recent = [h for h in token_holders if h.state == policy.EVICTED and h.evicted_at is not None
              and now - h.evicted_at < cfg.eviction_cooldown_s]
    if not recent:
        return None
    last = max(recent, key=lambda h: h.evicted_at or 0.0)
    ago = now - (last.evicted_at or now)
    rest = cfg.eviction_cooldown_s - ago
    return Claim(
        "refuse",
        f"participant {last.id!r} of this token was evicted by an admin {ago:.0f}s ago: for {rest:.0f}s more "
        f"(eviction_cooldown_s {cfg.eviction_cooldown_s:g}) this token may not add participants or take over "
        "names; its participants that present their keys are not affected",
        403, "evicted_recently", retry_after_s=rest,
    )


def join_rule(name: str, held: Holder | None, token_holders: Sequence[Holder], *, key_ok: bool, now: float,
              cfg: RunConfig) -> Claim:
    """The decision on a join as `name` with a participant token (the admin's joins are not
    ruled): the name's claim (`_claim_name`), then, when the join takes a new key, the
    token's eviction cool-down, and, when it makes the participant active, the token's cap."""
    claim = _claim_name(name, held, key_ok, now, cfg)
    if claim.action == "refuse":
        return claim
    if claim.action != "rejoin":
        refused = _cooled_down(token_holders, now, cfg)
        if refused is not None:
            return refused
    if held is None or held.state != policy.ACTIVE:
        refused = within_cap(token_holders, name, cfg)
        if refused is not None:
            return refused
    return claim


def require_admin(ident: Identity, what: str) -> None:
    """Refuse (403 `admin_only`) unless `ident` holds the admin token."""
    if not ident.is_admin:
        raise Refused(403, "admin_only", f"{what} needs the admin token")
