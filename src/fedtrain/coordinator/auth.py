"""Bearer-token roles of the coordinator: participant tokens and one admin token.

Tokens are compared in constant time and never logged; a participant is bound to a
fingerprint (a hash prefix) of the token it joined with, never to the token itself.
A participant token can be revoked by its fingerprint (`Tokens.revoked`): from then on
it identifies no one, and the coordinator keeps the revocation across restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

PARTICIPANT = "participant"
ADMIN = "admin"
ROLE_CHECK_ATTR = "fedtrain_role_check"
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


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass
class Tokens:
    participant: list[str] = field(default_factory=list)
    admin: str | None = None
    revoked: set[str] = field(default_factory=set)  # fingerprints of revoked participant tokens

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
