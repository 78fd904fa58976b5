"""The SQLite store: migrations, config versions, participants, round commits, events."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedtrain.coordinator.state.store import MIGRATIONS, ParticipantRow, Store
from fedtrain.errors import StateError


def test_new_store_is_migrated_and_wal(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.db")
    assert store.schema_version() == len(MIGRATIONS)
    assert store.journal_mode() == "wal"
    assert store.committed_version() is None
    store.close()
    store = Store(tmp_path / "run.db")  # reopening runs no migration twice
    assert store.committed_version() is None


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "run.db")
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 5}")
    db.close()
    with pytest.raises(StateError, match="newer fedtrain"):
        Store(tmp_path / "run.db")


def test_not_a_database_is_a_state_error(tmp_path: Path) -> None:
    (tmp_path / "run.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateError, match="not a usable fedtrain database"):
        Store(tmp_path / "run.db")


def test_config_versions_increase(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.db")
    assert store.add_config_version({"a": 1}, "start") == 1
    assert store.add_config_version({"a": 2}, "admin", {"a": [1, 2]}) == 2
    assert store.latest_config() == (2, {"a": 2})


def test_participants_round_trip(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.db")
    row = ParticipantRow("p0", "p0", "abc", "active", 1.0, 2.0, 0, 0, 0, 0, {"host": "x"})
    store.upsert_participant(row)
    row.state, row.tokens = "failed", 99
    store.upsert_participant(row)
    [back] = store.participants()
    assert back.state == "failed" and back.tokens == 99 and back.info == {"host": "x"}


def test_commit_round_sets_version_and_weights(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.db")
    store.add_submission(0, "a", 30, 100, "sha256:x")
    store.add_submission(0, "b", 10, 100, "sha256:y")
    record = {
        "round": 0,
        "opened_at": 0.0,
        "closed_at": 1.0,
        "close_reason": "all",
        "algorithm": "diloco",
        "n_submissions": 2,
        "tokens": 40,
        "bytes_in": 200,
        "merge_s": 0.1,
        "digest": "sha256:g",
    }
    store.commit_round(record, {"a": 0.75, "b": 0.25})
    assert store.committed_version() == 1
    assert store.get_meta("digest/1") == "sha256:g"
    [r] = store.rounds()
    assert [(s["participant_id"], s["weight"]) for s in r["submissions"]] == [("a", 0.75), ("b", 0.25)]


def test_failed_commit_rolls_back(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.db")
    record = {
        "round": 0,
        "opened_at": 0.0,
        "closed_at": 1.0,
        "close_reason": "x",
        "algorithm": "fedavg",
        "n_submissions": 0,
        "tokens": 0,
        "bytes_in": 0,
        "merge_s": 0.0,
        "digest": "d",
    }
    store.commit_round(record, {})
    with pytest.raises(sqlite3.IntegrityError):
        store.commit_round(record, {})  # the same round twice: the whole transaction is refused
    assert store.committed_version() == 1


def test_discard_uncommitted_and_events(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.db")
    store.add_submission(2, "a", 1, 1, "d")
    store.add_submission(3, "a", 1, 1, "d")
    assert store.discard_uncommitted(3) == 1
    assert [s["round"] for s in store.submissions(2)] == [2]
    store.add_event("join", "a joined", "a")
    store.add_metrics("a", 2, 10, {"loss": 1.5})
    assert store.events()[-1]["message"] == "a joined"
    assert store.metrics("loss")[0]["value"] == 1.5
