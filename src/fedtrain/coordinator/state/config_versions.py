"""The run's config versions: the one in force, the newest accepted, and live changes.

`ConfigVersions` owns the config in force for the open round and its version, the newest
accepted version and the config file's last applied copy. Event loop only.

More: docs/architecture.md, "coordinator/state/config_versions.py".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig, check_upload_limit, load_config, parse_config
from fedtrain.config.changes import apply_change, change_notes, config_diff, patch_of
from fedtrain.coordinator import policy
from fedtrain.coordinator.members.auth import Identity, require_admin
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import ConfigError, Refused, StateError
from fedtrain.wire.compress import Codec, expected_specs

#: The store's meta key for the config file as last applied: the base of a SIGHUP's merge.
CONFIG_FILE_META = "config_file"

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def update_bytes(spec: Spec, cfg: RunConfig) -> int:
    """The tensor bytes of one update of a model of `spec` under `cfg` (its compression):
    the smallest upload limit that can work (the body adds a header on top)."""
    specs = expected_specs(dict(spec), Codec.for_train(cfg.train))
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())


class ConfigVersions:
    """The config in force (`config`, `version`), the newest accepted (`latest_version`)."""

    def __init__(self, store: Store, events: Events, config_path: Path | None = None) -> None:
        self._store = store
        self._events = events
        self.config_path = config_path
        self.config = RunConfig()  # set by `create` or `load`
        self.version = 0
        self.latest_version = 0
        self.spec: Spec = {}
        # The given config against the stored one at a restart, not applied (`reconcile`).
        self.file_diff: dict[str, list[Any]] = {}

    def update_bytes(self, cfg: RunConfig) -> int:
        return update_bytes(self.spec, cfg)

    # -- at the start -------------------------------------------------------------------------

    def create(self, cfg: RunConfig, spec: Spec) -> None:
        """A new run: `cfg` is version 1, in force from round 0."""
        self.spec = spec
        check_upload_limit(cfg, self.update_bytes(cfg), source="run config")
        self.config = cfg
        self.version = self.latest_version = self._store.add_config_version(cfg.model_dump(mode="json"),
                                                                            author="start")
        if self.config_path is not None:
            self._store.set_meta(CONFIG_FILE_META, json.dumps(cfg.model_dump(mode="json")))

    def load(self, round_: int, state_dir: Path) -> RunConfig:
        """A stored run: the config in force at `round_` becomes the one in force."""
        stored = self._store.config_for_round(round_)
        if stored is None:
            raise StateError(f"{state_dir}: the database has rounds but no config; the state is damaged")
        self.version, data = stored
        self.config = parse_config(data, source=f"stored config of {state_dir}")
        self.latest_version = max(self.version, self._latest()[0])
        return self.config

    def reconcile(self, given: RunConfig, round_: int, spec: Spec, apply: bool, state_dir: Path) -> None:
        """A config given at the restart of a stored run: the stored run's config stays in force
        and the differences are kept in `file_diff` for the caller to show, unless `apply`,
        which validates the given one as a change and stores it as a new version with its
        true diff, in force from `round_`."""
        self.spec = spec
        latest = parse_config(self._latest()[1], source=f"stored config of {state_dir}")
        if given.model != latest.model:
            raise StateError(
                f"{state_dir} holds a run of a different model ({latest.model.model_dump()}); "
                "use a new --state-dir, or start without --config to resume the stored run"
            )
        diff = config_diff(latest.model_dump(mode="json"), given.model_dump(mode="json"))
        if self.config_path is not None and self._store.get_meta(CONFIG_FILE_META) is None:
            self._store.set_meta(CONFIG_FILE_META, json.dumps(given.model_dump(mode="json")))  # SIGHUP's base
        if not diff:
            return
        where = str(self.config_path) if self.config_path is not None else "the given config"
        if not apply:
            self.file_diff = diff
            changes = ", ".join(f"{k}: {a} (stored) vs {b} (file)" for k, (a, b) in diff.items())
            self._store.add_event("config", f"restarted with {where}, which differs from the stored run; the stored "
                                            "config stays in force (--apply-config applies the file): " + changes)
            return
        new, diff = apply_change(latest, given.model_dump(mode="json"), source=where, update_bytes=self.update_bytes)
        self.version = self._store.add_config_version(
            new.model_dump(mode="json"), author="start --apply-config", diff=diff, effective_round=round_
        )
        self.latest_version = max(self.latest_version, self.version)
        self.config = new
        if self.config_path is not None:
            self._store.set_meta(CONFIG_FILE_META, json.dumps(given.model_dump(mode="json")))
        changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        notes = "".join(f"; {n}" for n in change_notes(latest, new))
        self._store.add_event("config", f"config v{self.version} from {where} applied at the restart "
                                        f"(--apply-config), in force from round {round_}: {changes}{notes}")

    # -- reading --------------------------------------------------------------------------------

    def _latest(self) -> tuple[int, dict[str, Any]]:
        found = self._store.latest_config()
        assert found is not None  # a run always has its first version
        return found

    def for_round(self, round_: int, current: int) -> RunConfig:
        """The config a participant trained round `round_` with (the one in force then)."""
        found = self._store.config_for_round(round_) if round_ < current else None
        return self.config if found is None else parse_config(found[1], source=f"config of round {round_}")

    def view(self, round_: int | None, current: int) -> dict[str, Any]:
        """The config in force at `round_` (default: now), with the newest accepted version."""
        if round_ is None or round_ == current:
            version, cfg = self.version, self.config.model_dump(mode="json")
        else:
            found = self._store.config_for_round(round_)
            if found is None:
                raise Refused(404, "no_config", f"no config was in force at round {round_}")
            version, cfg = found
        return {"version": version, "config": cfg, "round": current if round_ is None else round_,
                "latest_version": self.latest_version}

    # -- changes ----------------------------------------------------------------------------------

    def validate(self, ident: Identity, patch: Any) -> dict[str, Any]:
        """Dry run of a change: valid or not, the reason, and the diff it would make."""
        require_admin(ident, "validating a config change")
        latest = parse_config(self._latest()[1])
        try:
            new, diff = apply_change(latest, patch, update_bytes=self.update_bytes)
        except ConfigError as e:
            return {"valid": False, "error": e.message, "diff": {}, "notes": []}
        return {"valid": True, "error": None, "diff": diff, "notes": change_notes(latest, new)}

    def change(self, patch: Any, author: str, current: int, started: bool) -> dict[str, Any]:
        """Accept a change (validated against the newest version) as a new version, in force
        from the round `policy.change_effective` names (`started`: someone has started the
        open round `current`). The caller puts it in force (`enter`) when that is now."""
        latest = parse_config(self._latest()[1])
        new, diff = apply_change(latest, patch, update_bytes=self.update_bytes)
        notes = change_notes(latest, new)
        if not diff:
            return {"version": self.latest_version, "changed": False, "diff": {}, "effective_round": current,
                    "notes": []}
        effective, why = policy.change_effective(current, started)
        version = self._store.add_config_version(new.model_dump(mode="json"), author=author, diff=diff,
                                                 effective_round=effective)
        self.latest_version = version
        changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        self._events.record("config", f"config v{version} accepted from {author}, in force from round "
                                      f"{effective}: {changes}" + "".join(f"; {n}" for n in notes) + f" ({why})")
        self._events.publish("config_change", {"version": version, "effective_round": effective, "diff": diff})
        return {"version": version, "changed": True, "diff": diff, "effective_round": effective, "notes": notes}

    def enter(self, round_: int) -> bool:
        """At a round boundary: put in force the newest version meant for `round_`; whether
        the config in force changed."""
        found = self._store.config_for_round(round_)
        if found is None or found[0] == self.version:
            return False
        version, data = found
        self.version, self.config = version, parse_config(data, source=f"config v{version}")
        self._events.record("config", f"config v{version} in force from round {round_}")
        return True

    def file_patch(self) -> tuple[dict[str, Any], list[str], dict[str, Any]] | None:
        """SIGHUP: what changed in the config file since it was last read, as a patch to the
        newest version; with the fields changed live that the file does not change (kept) and
        the file as read now. None (and an event) when the file is invalid.

        A three-way merge, so that a reload does not undo the admin's live changes: the fields
        the file changes (against the file as last applied, kept in the store) are applied to
        the newest version; a field changed live and not in the file keeps its live value."""
        assert self.config_path is not None
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self._events.record("config", f"reload of {self.config_path} refused: {e.message}")
            return None
        file_now = new.model_dump(mode="json")
        latest = self._latest()[1]
        saved = self._store.get_meta(CONFIG_FILE_META)
        if saved is None:  # never recorded (a run from before this was kept): the whole file
            return patch_of(config_diff(latest, file_now)), [], file_now
        base = json.loads(saved)
        edited = config_diff(base, file_now)
        kept = [k for k in config_diff(base, latest) if k not in edited]
        return patch_of(edited), kept, file_now

    def file_applied(self, file_now: dict[str, Any], changed: bool, kept: list[str]) -> None:
        """SIGHUP: the file's patch was accepted; it is the base of the next reload."""
        where = str(self.config_path)
        self._store.set_meta(CONFIG_FILE_META, json.dumps(file_now))
        if not changed:
            self._events.record("config", f"reload of {where}: nothing in the file changed since it was last read")
        if kept:
            self._events.record("config", f"reload of {where} kept the live changes to {', '.join(kept)}, which the "
                                          "file does not make (edit the file, or change them live, to change them)")
