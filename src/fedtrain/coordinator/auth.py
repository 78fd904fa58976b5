"""Bearer-token roles of the coordinator: participant tokens and one admin token.

Tokens are compared in constant time and never logged; a participant is bound to a
fingerprint (a hash prefix) of the token it joined with, never to the token itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field

PARTICIPANT = "participant"
ADMIN = "admin"


@dataclass(frozen=True)
class Identity:
    role: str
    token_id: str

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass
class Tokens:
    participant: list[str] = field(default_factory=list)
    admin: str | None = None

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
        return secrets.token_urlsafe(24)

    def identify(self, authorization: str | None) -> Identity | None:
        """The identity behind an `Authorization: Bearer …` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        token = token.strip()
        found: Identity | None = None
        # Compare against every token so that timing says nothing about which one matched.
        if self.admin is not None and hmac.compare_digest(token.encode(), self.admin.encode()):
            found = Identity(ADMIN, fingerprint(token))
        for candidate in self.participant:
            if hmac.compare_digest(token.encode(), candidate.encode()) and found is None:
                found = Identity(PARTICIPANT, fingerprint(token))
        return found
