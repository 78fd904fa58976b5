"""Opening a run: create it in a new state directory, or resume it from a stored one.

More: docs/architecture.md, "coordinator/lifecycle.py".
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator.intake.flow import Intake
from fedtrain.coordinator.intake.uploads import Uploads
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.coordinator.members.roster import Roster
from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.rounds.fragment_plan import plan_for
from fedtrain.coordinator.rounds.open_round import OpenRound
from fedtrain.coordinator.rounds.progress import Rounds
from fedtrain.coordinator.rounds.schedule import Schedule
from fedtrain.coordinator.state.config_versions import ConfigVersions
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import FedtrainError, StateError
from fedtrain.transport import fast_io_enabled
from fedtrain.wire import iter_file, read_tensors

log = logging.getLogger("fedtrain.coordinator")

Spec = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def initial_weights(cfg: RunConfig, init_file: Path | None) -> dict[str, torch.Tensor]:
    """The run's version-0 weights: a safetensors file given at start, or the recipe from its seed."""
    if init_file is not None:
        try:
            return {k: v.float() if v.is_floating_point() else v for k, v in read_tensors(iter_file(init_file))}
        except (OSError, FedtrainError) as e:
            raise StateError(f"cannot read initial weights {init_file}: {e}") from None
    from fedtrain.recipes import build_model

    model = build_model(cfg.model, seed=cfg.seed)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def frozen_base_fingerprint(cfg: RunConfig, init_file: Path | None) -> str | None:
    """For LoRA runs of a recipe model: the hash of the frozen base every participant must share."""
    if init_file is not None or cfg.model.lora is None:
        return None
    from fedtrain.recipes import base_fingerprint, build_model

    return base_fingerprint(build_model(cfg.model, seed=cfg.seed))


@dataclass(frozen=True)
class Given:
    """What the command that opens the run gave: a config (on a stored run the stored one wins
    unless `apply_config`), initial weights, and whether to `recover` from a damaged checkpoint."""

    config: RunConfig | None = None
    init_weights: Path | None = None
    apply_config: bool = False
    recover: bool = False
    fast_io: bool | None = None


@dataclass(frozen=True)
class Parts:
    store: Store
    spool: Path
    spec: Spec
    configs: ConfigVersions
    committer: Committer
    intake: Intake
    roster: Roster
    rounds: Rounds
    uploads: Uploads
    schedule: Schedule


def open_run(state_dir: Path, given: Given, config_path: Path | None, events: Events, tokens: Tokens,
             clock: Callable[[], float], fold_lock: threading.Lock) -> Parts:
    """Every part of a run over `state_dir`, created or resumed (the caller holds its lock)."""
    store = Store(state_dir / "run.db")
    events.attach(store)
    fast_io = fast_io_enabled(given.fast_io)
    ckpt = CheckpointDir(state_dir / "checkpoints", fast_io=fast_io)
    ckpt.remove_temp_files()
    spool = state_dir / "spool"
    shutil.rmtree(spool, ignore_errors=True)
    spool.mkdir()
    configs = ConfigVersions(store, events, config_path)
    committer = Committer(ckpt, store, events, fold_lock)
    committed = store.committed_version()
    if committed is None:
        version = _create(store, configs, committer, given)
    else:
        version = _resume(store, configs, committer, given, committed, state_dir)
    spec = committer.spec()
    configs.spec = spec
    plan = plan_for(configs.config, list(spec))  # in the model's order, which every checkpoint keeps
    intake = Intake(spool, spec, committer.params(), fold_lock, fast_io=fast_io)
    roster = Roster(store, events, tokens, clock)
    recent = [[max(0.0, s["received_at"] - row["opened_at"]) for s in store.submissions(row["round"])]
              for row in reversed(store.rounds(limit=configs.config.deadline_window))]
    rounds = Rounds(OpenRound(version, clock(), recent), roster, configs, intake, committer, store, events, clock,
                    plan)
    uploads = Uploads(rounds, roster, configs, intake, store, events)
    tokens.revoked.update(json.loads(store.get_meta("revoked_tokens") or "[]"))
    return Parts(store, spool, spec, configs, committer, intake, roster, rounds, uploads, Schedule(store, events))


def _create(store: Store, configs: ConfigVersions, committer: Committer, given: Given) -> int:
    cfg = given.config or RunConfig()
    params = initial_weights(cfg, given.init_weights)
    plan_for(cfg, list(params))  # a streaming assignment that does not fit the model stops here, before any write
    configs.create(cfg, {n: (t.dtype, tuple(t.shape)) for n, t in params.items()})
    digest = committer.create(params, cfg)
    with store.write() as db:
        store.set_meta("global_version", "0", db)
        store.set_meta("digest/0", digest, db)
        store.set_meta("created_at", str(time.time()), db)
        # What the model is, for `config show` and `export`: the recipe of the config, or a model of
        # the user's own whose version 0 came from a file (the config's `model` section is then unused).
        store.set_meta("model_source", "recipe" if given.init_weights is None else "init_weights", db)
        if given.init_weights is not None:
            store.set_meta("init_weights", given.init_weights.name, db)
        base = frozen_base_fingerprint(cfg, given.init_weights)
        if base is not None:
            store.set_meta("base_fingerprint", base, db)
    store.add_event(
        "run",
        f"run {cfg.name!r} created: {len(params)} tensors, {sum(t.numel() for t in params.values()):,} parameters",
    )
    return 0


def _resume(store: Store, configs: ConfigVersions, committer: Committer, given: Given, committed: int,
            state_dir: Path) -> int:
    cfg = configs.load(committed, state_dir)
    version = committer.load(committed, cfg, given.recover)
    if given.config is not None:
        configs.reconcile(given.config, version, committer.spec(), given.apply_config, state_dir)
    committer.reconfigure(configs.config)
    dropped = store.discard_uncommitted(version)
    committer.ckpt.prune(version, configs.config.keep_checkpoints)
    store.add_event(
        "run", f"resumed at round {version} (last committed); {dropped} uncommitted submissions to be sent again"
    )
    return version
