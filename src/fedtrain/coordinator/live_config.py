"""The live config: shared by the run, versioned in the store, changed at round boundaries.

A part (mixin) of `Coordinator` (`service.py`). A change from the admin, or the config
file read again on SIGHUP, is validated against the newest version and stored as a new
version; it comes into force at the next round boundary (`_enter_round`), or at once when
no one has started the open round. The outer optimizer follows the config in force,
keeping its state where the new settings still fit it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fedtrain.config import RunConfig, outer_defaults, parse_config
from fedtrain.config_changes import apply_change, change_notes
from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import Identity
from fedtrain.coordinator.base import CoordinatorBase, Refused
from fedtrain.errors import ConfigError, MergeError
from fedtrain.merge import OuterOptimizer
from fedtrain.wire.compress import expected_specs

#: The store's meta key for the config file as last applied: the base of a SIGHUP's merge.
CONFIG_FILE_META = "config_file"


class LiveConfigMixin(CoordinatorBase):
    """The coordinator's config: in force now, in force at a past round, changed live."""

    def _reconfigure_outer(self) -> None:
        """Make the outer optimizer match the config in force: a new algorithm starts with fresh
        state; new hyperparameters keep the state where it still fits."""
        want_alg, want_hp = self.config.outer.algorithm, outer_defaults(self.config.outer)
        if self.outer.algorithm == want_alg and self.outer.hp == want_hp:
            return
        params = self.outer.params
        if self.outer.algorithm != want_alg:
            self.outer = OuterOptimizer(params, want_alg, want_hp)
            self._event("config", f"outer optimizer switched to {want_alg} with fresh state")
            return
        meta = {**self.outer.state_metadata(), "hp": json.dumps(want_hp)}
        try:
            self.outer = OuterOptimizer.restore(params, self.outer.state_tensors(), meta)
        except MergeError:
            self.outer = OuterOptimizer(params, want_alg, want_hp)
            self._event("config", f"outer optimizer state reset: the new {want_alg} settings need other state")

    def _enter_round(self) -> None:
        """At a round boundary: put in force the newest config version meant for this round."""
        found = self.store.config_for_round(self.version)
        if found is None or found[0] == self.config_version:
            return
        version, data = found
        self.config_version, self.config = version, parse_config(data, source=f"config v{version}")
        with self._fold_lock:
            self._reconfigure_outer()
        self._event("config", f"config v{version} in force from round {self.version}")
        self.broadcast.publish("config", self.config_view(None))

    def config_view(self, round_: int | None) -> dict[str, Any]:
        """The config in force at `round_` (default: now), with the newest accepted version."""
        if round_ is None or round_ == self.version:
            version, cfg = self.config_version, self.config.model_dump(mode="json")
        else:
            found = self.store.config_for_round(round_)
            if found is None:
                raise Refused(404, "no_config", f"no config was in force at round {round_}")
            version, cfg = found
        return {"version": version, "config": cfg, "round": self.version if round_ is None else round_,
                "latest_version": self.latest_config_version}

    def validate_config(self, ident: Identity, patch: Any) -> dict[str, Any]:
        """Dry run of a change: valid or not, the reason, and the diff it would make."""
        self._require_admin(ident, "validating a config change")
        latest = parse_config(self.store.latest_config()[1])  # type: ignore[index]
        try:
            new, diff = apply_change(latest, patch, update_bytes=self.update_bytes)
        except ConfigError as e:
            return {"valid": False, "error": e.message, "diff": {}, "notes": []}
        return {"valid": True, "error": None, "diff": diff, "notes": change_notes(latest, new)}

    def update_bytes(self, cfg: RunConfig) -> int:
        """The tensor bytes of one update of this run's model under `cfg` (its compression):
        the smallest upload limit that can work (the body adds a header on top)."""
        specs = expected_specs(self.spec, cfg.train.compression, cfg.train.compression_block)
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())

    def change_config(self, ident: Identity, patch: Any, *, author: str | None = None) -> dict[str, Any]:
        """Accept a live change (validated against the newest version) as a new version that
        takes effect at the next round boundary — at once if no one has started this round."""
        if author is None:
            self._require_admin(ident, "changing the config")
        latest = parse_config(self.store.latest_config()[1])  # type: ignore[index]
        new, diff = apply_change(latest, patch, update_bytes=self.update_bytes)
        notes = change_notes(latest, new)
        if not diff:
            return {"version": self.latest_config_version, "changed": False, "diff": {},
                    "effective_round": self.version, "notes": []}
        idle = not self.submitted and not any(p.state == policy.ACTIVE for p in self.participants.values())
        effective = self.version if idle else self.version + 1
        version = self.store.add_config_version(new.model_dump(mode="json"), author=author or ident.role, diff=diff,
                                                effective_round=effective)
        self.latest_config_version = version
        changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        self._event("config", f"config v{version} accepted from {author or ident.role}, in force from round "
                              f"{effective}: {changes}" + "".join(f"; {n}" for n in notes))
        self.broadcast.publish("config_change", {"version": version, "effective_round": effective, "diff": diff})
        if effective == self.version:
            self._enter_round()
            self._notify()
        return {"version": version, "changed": True, "diff": diff, "effective_round": effective, "notes": notes}

    def reload_config_file(self) -> None:
        """SIGHUP: apply what changed in the config file since it was last read, as a live change.

        A three-way merge, so that a reload does not undo the admin's live changes: the fields
        the file changes (against the file as last applied, kept in the store) are applied to
        the newest version; a field changed live and not in the file keeps its live value, and
        the event says which were kept. An invalid file changes nothing."""
        from fedtrain.config import load_config
        from fedtrain.config_changes import config_diff, patch_of

        assert self.config_path is not None
        where = str(self.config_path)
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self._event("config", f"reload of {where} refused: {e.message}")
            return
        file_now = new.model_dump(mode="json")
        latest = self.store.latest_config()[1]  # type: ignore[index]
        saved = self.store.get_meta(CONFIG_FILE_META)
        if saved is None:  # never recorded (a run from before this was kept): the whole file
            edited, kept = config_diff(latest, file_now), []
        else:
            base = json.loads(saved)
            edited = config_diff(base, file_now)
            kept = [k for k in config_diff(base, latest) if k not in edited]
        try:
            result = self.change_config(Identity("admin", "file"), patch_of(edited), author="file")
        except ConfigError as e:
            self._event("config", f"reload of {where} refused: {e.message}")
            return
        self.store.set_meta(CONFIG_FILE_META, json.dumps(file_now))
        if not result["changed"]:
            self._event("config", f"reload of {where}: nothing in the file changed since it was last read")
        if kept:
            self._event("config", f"reload of {where} kept the live changes to {', '.join(kept)}, which the file "
                                  "does not make (edit the file, or change them live, to change them)")
