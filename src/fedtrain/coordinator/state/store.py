"""SQLite run metadata of a coordinator: rounds, participants, submissions, metrics, events.

One connection, one writer: every write runs in `BEGIN IMMEDIATE` under a lock, the
journal is WAL (reads never block), and the schema grows by numbered migrations recorded
in `PRAGMA user_version`. Tensors never live here: the global model and the outer
optimizer state are safetensors files next to the database (see `checkpoints.py`); a row
in `rounds` is what makes a round committed.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedtrain.errors import StateError

#: Rows the metrics table keeps, newest first: with names of at most 200 characters (one report:
#: 1,000 values, `roster.MAX_METRIC_VALUES`) a row is under ~300 bytes, so the table stays under
#: ~150 MB however long participants report. A run of 1,000 rounds with 8 participants reporting
#: 20 values around each sync stores 160,000.
MAX_METRIC_ROWS = 500_000
#: Events the events table keeps, newest first (the coordinator writes them, one line each; joins
#: and leaves of a participant add two).
MAX_EVENT_ROWS = 200_000

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE config_versions (
        version INTEGER PRIMARY KEY, created_at REAL NOT NULL, author TEXT NOT NULL,
        config TEXT NOT NULL, diff TEXT NOT NULL DEFAULT '{}');
    CREATE TABLE participants (
        id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, token_id TEXT NOT NULL,
        state TEXT NOT NULL, joined_at REAL NOT NULL, last_seen REAL NOT NULL,
        round INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
        bytes_up INTEGER NOT NULL DEFAULT 0, bytes_down INTEGER NOT NULL DEFAULT 0,
        info TEXT NOT NULL DEFAULT '{}');
    CREATE TABLE rounds (
        round INTEGER PRIMARY KEY, opened_at REAL NOT NULL, closed_at REAL NOT NULL,
        close_reason TEXT NOT NULL, algorithm TEXT NOT NULL, n_submissions INTEGER NOT NULL,
        tokens INTEGER NOT NULL, bytes_in INTEGER NOT NULL, merge_s REAL NOT NULL,
        digest TEXT NOT NULL);
    CREATE TABLE submissions (
        round INTEGER NOT NULL, participant_id TEXT NOT NULL, tokens INTEGER NOT NULL,
        weight REAL, bytes INTEGER NOT NULL, digest TEXT NOT NULL, received_at REAL NOT NULL,
        PRIMARY KEY (round, participant_id));
    CREATE TABLE metrics (
        id INTEGER PRIMARY KEY, ts REAL NOT NULL, participant_id TEXT, round INTEGER,
        step INTEGER, name TEXT NOT NULL, value REAL NOT NULL);
    CREATE INDEX metrics_round ON metrics (round);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL,
        participant_id TEXT, message TEXT NOT NULL);
    """,
    # 2: a config version takes effect at a round boundary
    """
    ALTER TABLE config_versions ADD COLUMN effective_round INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE participants ADD COLUMN config_version INTEGER;
    """,
    # 3: each participant acts only as itself (its key's sha256), and when it was evicted
    """
    ALTER TABLE participants ADD COLUMN key_hash TEXT;
    ALTER TABLE participants ADD COLUMN evicted_at REAL;
    """,
    # 4: balanced rounds: the inner steps each participant was told for a round, fixed once told
    """
    CREATE TABLE assignments (
        round INTEGER NOT NULL, participant_id TEXT NOT NULL, sync_every INTEGER NOT NULL,
        steps_per_s REAL, reason TEXT NOT NULL, told_at REAL NOT NULL,
        PRIMARY KEY (round, participant_id));
    CREATE INDEX assignments_participant ON assignments (participant_id, round);
    """,
    # 5: Streaming DiLoCo: the fragment a committed round synced (NULL: no streaming, or a round
    # a roll back closed with no updates)
    """
    ALTER TABLE rounds ADD COLUMN fragment INTEGER;
    """,
    # 6: named participant tokens, one per site, minted at run time: only each token's sha256 is kept
    """
    CREATE TABLE participant_tokens (
        token_id TEXT PRIMARY KEY, name TEXT NOT NULL, digest TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL, revoked_at REAL);
    """,
]


@dataclass
class ParticipantRow:
    id: str
    name: str
    token_id: str
    state: str
    joined_at: float
    last_seen: float
    round: int
    tokens: int
    bytes_up: int
    bytes_down: int
    info: dict[str, Any]
    config_version: int | None = None
    key_hash: str | None = None  # sha256 of its participant key (`auth.key_hash`); None: joined before keys
    evicted_at: float | None = None
    # Not stored: whether this coordinator process has heard from it with its key (`auth.join_rule`).
    proven: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class TokenRow:
    """A named participant token as stored: its sha256 (`digest`), never the token itself."""

    token_id: str  # the token's fingerprint (the first 12 hex digits of `digest`), as participants record it
    name: str  # the site it was minted for, e.g. "site-a"
    digest: str
    created_at: float
    revoked_at: float | None = None


class Store:
    """The coordinator's database. Thread-safe; all writes are serialized."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as e:
            raise StateError(f"cannot open the run database {self.path}: {e}") from None
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path} is not a usable fedtrain database: {e}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- plumbing ---------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE … COMMIT, rolled back on error)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise StateError(
                f"{self.path} was written by a newer fedtrain (schema {version}, "
                f"this one knows {len(MIGRATIONS)}); upgrade fedtrain"
            )
        for number in range(version, len(MIGRATIONS)):
            with self.write() as db:
                for statement in MIGRATIONS[number].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {number + 1}")

    # -- meta -------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        rows = self._query("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0]["value"] if rows else None

    def set_meta(self, key: str, value: str, db: sqlite3.Connection | None = None) -> None:
        sql = "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value"
        if db is not None:
            db.execute(sql, (key, value))
            return
        with self.write() as w:
            w.execute(sql, (key, value))

    def committed_version(self) -> int | None:
        """The global model version of the last committed round (None: a new state dir)."""
        value = self.get_meta("global_version")
        return int(value) if value is not None else None

    # -- config -----------------------------------------------------------------------------

    def add_config_version(self, config: dict, author: str, diff: dict | None = None, effective_round: int = 0) -> int:
        with self.write() as db:
            row = db.execute("SELECT COALESCE(MAX(version), 0) FROM config_versions").fetchone()
            version = int(row[0]) + 1
            db.execute(
                "INSERT INTO config_versions (version, created_at, author, config, diff, effective_round)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (version, time.time(), author, json.dumps(config), json.dumps(diff or {}), effective_round),
            )
        return version

    def latest_config(self) -> tuple[int, dict] | None:
        rows = self._query("SELECT version, config FROM config_versions ORDER BY version DESC LIMIT 1")
        return (int(rows[0]["version"]), json.loads(rows[0]["config"])) if rows else None

    def config_for_round(self, round_: int) -> tuple[int, dict] | None:
        """The newest config version in force at round `round_`."""
        rows = self._query(
            "SELECT version, config FROM config_versions WHERE effective_round <= ? ORDER BY version DESC LIMIT 1",
            (round_,),
        )
        return (int(rows[0]["version"]), json.loads(rows[0]["config"])) if rows else None

    def config_history(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT version, created_at, author, diff, effective_round FROM config_versions "
            "ORDER BY version DESC LIMIT ?",
            (limit,),
        )
        return [{**dict(r), "diff": json.loads(r["diff"])} for r in rows]

    # -- participants -----------------------------------------------------------------------

    def participants(self) -> list[ParticipantRow]:
        rows = self._query("SELECT * FROM participants ORDER BY id")
        return [_participant(r) for r in rows]

    def upsert_participant(self, row: ParticipantRow) -> None:
        self.upsert_participants([row])

    def upsert_participants(self, rows: list[ParticipantRow]) -> None:
        """Store these participants' rows, all in one transaction."""
        with self.write() as db:
            db.executemany(
                """INSERT INTO participants (id, name, token_id, state, joined_at, last_seen, round,
                       tokens, bytes_up, bytes_down, info, config_version, key_hash, evicted_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT(id) DO UPDATE SET state = excluded.state, last_seen = excluded.last_seen,
                       round = excluded.round, tokens = excluded.tokens, bytes_up = excluded.bytes_up,
                       bytes_down = excluded.bytes_down, info = excluded.info,
                       config_version = excluded.config_version,
                       key_hash = excluded.key_hash, evicted_at = excluded.evicted_at""",
                [
                    (row.id, row.name, row.token_id, row.state, row.joined_at, row.last_seen, row.round,
                     row.tokens, row.bytes_up, row.bytes_down, json.dumps(row.info), row.config_version,
                     row.key_hash, row.evicted_at)
                    for row in rows
                ],
            )

    def update_participants(self, rows: list[ParticipantRow]) -> None:
        """Store what changes of these participants' rows after their join (state, counters, key),
        in one transaction: not their `info`, written once by the join (`upsert_participants`), so
        that a heartbeat costs the same whatever the participant said of itself. A row that is
        not stored (pruned meanwhile) is not written back."""
        with self.write() as db:
            db.executemany(
                """UPDATE participants SET state = ?, last_seen = ?, round = ?, tokens = ?, bytes_up = ?,
                       bytes_down = ?, config_version = ?, key_hash = ?, evicted_at = ?
                   WHERE id = ?""",
                [
                    (row.state, row.last_seen, row.round, row.tokens, row.bytes_up, row.bytes_down,
                     row.config_version, row.key_hash, row.evicted_at, row.id)
                    for row in rows
                ],
            )

    def forget_participants(self, ids: list[str]) -> None:
        """Delete these participants' rows (departed long ago: `Roster` prunes them)."""
        with self.write() as db:
            db.executemany("DELETE FROM participants WHERE id = ?", [(pid,) for pid in ids])

    # -- named participant tokens -------------------------------------------------------------

    def participant_tokens(self) -> list[TokenRow]:
        """Every named participant token, revoked ones too, oldest first."""
        rows = self._query("SELECT * FROM participant_tokens ORDER BY created_at, token_id")
        return [TokenRow(**dict(r)) for r in rows]

    def add_participant_token(self, row: TokenRow) -> None:
        with self.write() as db:
            db.execute(
                "INSERT INTO participant_tokens (token_id, name, digest, created_at, revoked_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (row.token_id, row.name, row.digest, row.created_at, row.revoked_at),
            )

    def revoke_participant_token(self, token_id: str, at: float) -> None:
        """Mark a named token revoked (the first revocation's time stays)."""
        with self.write() as db:
            db.execute("UPDATE participant_tokens SET revoked_at = COALESCE(revoked_at, ?) WHERE token_id = ?",
                       (at, token_id))

    # -- rounds and submissions ---------------------------------------------------------------

    def add_submission(self, round_: int, participant_id: str, tokens: int, nbytes: int, digest: str) -> None:
        with self.write() as db:
            db.execute(
                "INSERT OR REPLACE INTO submissions (round, participant_id, tokens, weight, bytes, digest, received_at)"
                " VALUES (?, ?, ?, NULL, ?, ?, ?)",
                (round_, participant_id, tokens, nbytes, digest, time.time()),
            )

    def discard_uncommitted(self, version: int) -> int:
        """Forget submissions of rounds that never committed (their sums died with the process)."""
        with self.write() as db:
            cur = db.execute("DELETE FROM submissions WHERE round >= ?", (version,))
            return cur.rowcount

    def commit_round(self, record: dict[str, Any], weights: dict[str, float]) -> None:
        """Make round `record['round']` committed: its row, its weights, the new global version.
        `record["fragment"]`: the Streaming DiLoCo fragment it synced, if any."""
        with self.write() as db:
            db.execute(
                """INSERT INTO rounds (round, opened_at, closed_at, close_reason, algorithm, n_submissions,
                       tokens, bytes_in, merge_s, digest, fragment)
                   VALUES (:round, :opened_at, :closed_at, :close_reason, :algorithm, :n_submissions,
                       :tokens, :bytes_in, :merge_s, :digest, :fragment)""",
                {"fragment": None, **record},
            )
            for pid, w in weights.items():
                db.execute(
                    "UPDATE submissions SET weight = ? WHERE round = ? AND participant_id = ?",
                    (w, record["round"], pid),
                )
            self.set_meta("global_version", str(record["round"] + 1), db)
            self.set_meta(f"digest/{record['round'] + 1}", record["digest"], db)

    def rounds(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM rounds ORDER BY round DESC LIMIT ?", (limit,))
        out = [dict(r) for r in rows]
        for r in out:
            subs = self._query(
                "SELECT participant_id, tokens, weight, bytes FROM submissions WHERE round = ? ORDER BY participant_id",
                (r["round"],),
            )
            r["submissions"] = [dict(s) for s in subs]
        return out

    def newest_submission(self, participant_id: str) -> int | None:
        """The newest round holding an update of `participant_id`, or None."""
        rows = self._query("SELECT MAX(round) AS r FROM submissions WHERE participant_id = ?", (participant_id,))
        return None if rows[0]["r"] is None else int(rows[0]["r"])

    def applied(self, rounds: int) -> dict[str, tuple[int, float]]:
        """Per participant, over the newest `rounds` committed rounds: its updates and the sum of
        their recorded weights."""
        rows = self._query(
            "SELECT participant_id, COUNT(*) AS n, TOTAL(weight) AS w FROM submissions WHERE weight IS NOT NULL "
            "AND round > (SELECT COALESCE(MAX(round), -1) FROM rounds) - ? GROUP BY participant_id",
            (rounds,),
        )
        return {r["participant_id"]: (int(r["n"]), float(r["w"])) for r in rows}

    def submissions(self, round_: int) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM submissions WHERE round = ? ORDER BY received_at", (round_,))
        return [dict(r) for r in rows]

    def round_timings(self) -> list[tuple[float, float]]:
        """(duration_s, merge_s) of every committed round, oldest first (for /metrics)."""
        rows = self._query("SELECT closed_at - opened_at AS d, merge_s FROM rounds ORDER BY round")
        return [(max(0.0, float(r["d"])), float(r["merge_s"])) for r in rows]

    # -- balanced rounds: each participant's inner steps per round --------------------------------

    def add_assignment(self, round_: int, participant_id: str, sync_every: int, steps_per_s: float | None,
                       reason: str) -> None:
        """Record what `participant_id` was told for `round_`; the first record stays (told once)."""
        with self.write() as db:
            db.execute(
                "INSERT OR IGNORE INTO assignments (round, participant_id, sync_every, steps_per_s, reason, told_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (round_, participant_id, sync_every, steps_per_s, reason, time.time()),
            )

    def assignments(self, round_: int) -> dict[str, dict[str, Any]]:
        """What each participant was told for `round_`: {pid: {sync_every, steps_per_s, reason}}."""
        rows = self._query("SELECT participant_id, sync_every, steps_per_s, reason FROM assignments WHERE round = ?",
                           (round_,))
        return {r["participant_id"]: {k: r[k] for k in ("sync_every", "steps_per_s", "reason")} for r in rows}

    def last_assignments(self, before: int) -> dict[str, dict[str, Any]]:
        """Each participant's newest assignment of a round before `before` (its previous one)."""
        rows = self._query(
            "SELECT a.participant_id, a.sync_every, a.steps_per_s, a.reason FROM assignments a JOIN "
            "(SELECT participant_id, MAX(round) AS round FROM assignments WHERE round < ? GROUP BY participant_id) b "
            "ON a.participant_id = b.participant_id AND a.round = b.round",
            (before,),
        )
        return {r["participant_id"]: {k: r[k] for k in ("sync_every", "steps_per_s", "reason")} for r in rows}

    # -- metrics and events -----------------------------------------------------------------

    def add_metrics(
        self, participant_id: str | None, round_: int | None, step: int | None, values: dict[str, float]
    ) -> None:
        """Store one report; the table keeps its newest MAX_METRIC_ROWS rows (the oldest go)."""
        now = time.time()
        with self.write() as db:
            db.executemany(
                "INSERT INTO metrics (ts, participant_id, round, step, name, value) VALUES (?, ?, ?, ?, ?, ?)",
                [(now, participant_id, round_, step, k, float(v)) for k, v in values.items()],
            )
            # ids only grow: a range of the primary key, nothing to do (one lookup) until it is full
            db.execute("DELETE FROM metrics WHERE id <= (SELECT MAX(id) FROM metrics) - ?", (MAX_METRIC_ROWS,))

    def metrics(self, name: str | None = None, limit: int = 10000) -> list[dict[str, Any]]:
        if name is None:
            rows = self._query("SELECT * FROM metrics ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._query("SELECT * FROM metrics WHERE name = ? ORDER BY id DESC LIMIT ?", (name, limit))
        return [dict(r) for r in reversed(rows)]

    def add_event(self, kind: str, message: str, participant_id: str | None = None) -> None:
        """Store one event; the table keeps its newest MAX_EVENT_ROWS rows (the oldest go)."""
        with self.write() as db:
            db.execute(
                "INSERT INTO events (ts, kind, participant_id, message) VALUES (?, ?, ?, ?)",
                (time.time(), kind, participant_id, message),
            )
            db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (MAX_EVENT_ROWS,))

    def schema_version(self) -> int:
        """The database's migration number (SQLite's user_version)."""
        return int(self._query("PRAGMA user_version")[0][0])

    def journal_mode(self) -> str:
        return str(self._query("PRAGMA journal_mode")[0][0])

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(r) for r in reversed(rows)]


def _participant(r: sqlite3.Row) -> ParticipantRow:
    d = dict(r)
    d["info"] = json.loads(d["info"] or "{}")
    return ParticipantRow(**d)
