"""Named participant tokens, one per site: minted, adopted (a legacy tokens.json's) and revoked
by the run's admin while the run goes on, and kept across restarts as their sha256 only.

The mint's answer is the one time a token is shown; the store never holds it. A token's
fingerprint (`token_id`, the first 12 hex digits of its sha256) is what its participants are
bound to, as for tokens given at start, so eviction, its cool-down and the per-token cap
(`auth.join_rule`) apply per site.

More: docs/security.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fedtrain.coordinator.members.auth import Tokens, token_digest
from fedtrain.coordinator.state.store import Store, TokenRow
from fedtrain.errors import Refused

#: Named tokens a coordinator holds at most, revoked ones included (each refuses its holders
#: for as long as the run lasts, so they are kept).
MAX_TOKENS = 1000
#: The pattern of a token's name: a participant name's (1-64 letters, digits, '_', '.', '-').
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)


def check_name(name: str) -> None:
    """Refuse (422 `invalid_name`) a token name that is not 1-64 letters, digits, '_', '.' or '-'."""
    if not _NAME_RE.match(name):
        raise Refused(422, "invalid_name", f"token name {name[:80]!r} must be 1-64 letters, digits, '_', '.' or '-', "
                      "starting with a letter or digit", {"field": "name"})


class SiteTokens:
    """The run's named participant tokens. It owns `Tokens.named` and the revocations of named
    tokens in `Tokens.revoked`; every change is written to the store first."""

    def __init__(self, store: Store, tokens: Tokens, clock: Callable[[], float]) -> None:
        self._store = store
        self._tokens = tokens
        self._clock = clock
        rows = store.participant_tokens()
        tokens.named = {r.digest: r for r in rows}
        tokens.revoked.update(r.token_id for r in rows if r.revoked_at is not None)

    def rows(self) -> list[TokenRow]:
        """Every named token, revoked ones too, oldest first."""
        return sorted(self._tokens.named.values(), key=lambda r: (r.created_at, r.token_id))

    def by_id(self, token_id: str) -> TokenRow | None:
        return next((r for r in self._tokens.named.values() if r.token_id == token_id), None)

    def live_named(self, name: str) -> TokenRow | None:
        """The token called `name` that is not revoked, if any."""
        return next((r for r in self._tokens.named.values() if r.name == name and r.revoked_at is None), None)

    def listing(self, ids: set[str], given: set[str], holders: dict[str, list[str]]) -> list[dict[str, Any]]:
        """The tokens of GET /v1/admin/tokens: the named ones and `ids` (tokens given at start,
        `given`, and any a participant joined with), each with the participants that joined with
        it (`holders`); tokens given at start first, then named ones as they were minted."""
        named = {r.token_id: r for r in self._tokens.named.values()}
        out = []
        for t in sorted(ids | set(named), key=lambda i: (named[i].created_at if i in named else 0.0, i)):
            row = named.get(t)
            out.append({
                "token_id": t,
                "name": row.name if row is not None else None,
                "source": "minted" if row is not None else ("given at start" if t in given else "no longer given"),
                "created_at": row.created_at if row is not None else None,
                "revoked": t in self._tokens.revoked,
                "participants": sorted(holders.get(t, [])),
            })
        return out

    def mint(self, name: str) -> tuple[TokenRow, str]:
        """A new token for site `name`: (its row, the token, shown this once). Refused: a bad name
        (422), a name a live token has (409 `token_name_taken`), MAX_TOKENS held (409 `too_many_tokens`)."""
        check_name(name)
        if self.live_named(name) is not None:
            raise Refused(409, "token_name_taken", f"a live token is named {name!r} already: revoke it first, or "
                          "choose another name", {"field": "name"})
        if len(self._tokens.named) >= MAX_TOKENS:
            raise Refused(409, "too_many_tokens", f"this run holds {len(self._tokens.named)} named tokens, the most "
                          f"it keeps ({MAX_TOKENS}, revoked ones included: they go on refusing their holders)")
        token = Tokens.generate()
        return self._add(name, token), token

    def adopt(self, name: str, token: str) -> TokenRow | None:
        """Keep `token` (given in a legacy tokens.json) as a named one, unless it is already:
        the row added, or None. A name a live token has gets a suffix (`default-2`)."""
        digest = token_digest(token)
        if digest in self._tokens.named:
            return None
        base, n = name, 1
        while self.live_named(name) is not None:
            n += 1
            name = f"{base}-{n}"
        return self._add(name, token)

    def _add(self, name: str, token: str) -> TokenRow:
        digest = token_digest(token)
        row = TokenRow(digest[:12], name, digest, self._clock())
        self._store.add_participant_token(row)
        self._tokens.named = {**self._tokens.named, digest: row}
        return row

    def revoke(self, token_id: str) -> None:
        """Mark named token `token_id` revoked in the store (a token given at start is revoked by
        fingerprint alone: `Roster.revoke_token`)."""
        row = self.by_id(token_id)
        if row is None or row.revoked_at is not None:
            return
        now = self._clock()
        self._store.revoke_participant_token(token_id, now)
        revoked = TokenRow(row.token_id, row.name, row.digest, row.created_at, now)
        self._tokens.named = {**self._tokens.named, row.digest: revoked}
