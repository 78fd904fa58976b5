"""The committer: the global model, its outer optimizer, checkpoints, publishing, going back.

`Committer` owns the master weights and the outer optimizer state (`OuterOptimizer`), the
checkpoint directory, the version served from memory (`Published`; with compressed downloads
its delta and the error feedback: `DownloadDeltas`) and the guard that
orders copies of the weights against changes to them (`WeightsGuard`), the newest durable
version (`committed_version`), and the janitor thread that prunes old checkpoint files.

More: docs/architecture.md, "coordinator/model/committer.py".
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fedtrain import faults
from fedtrain.config import RunConfig, outer_choice
from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.deltas import DeltaStream, DownloadDeltas
from fedtrain.coordinator.model.downloads import DownloadsInFlight
from fedtrain.coordinator.model.publish import ModelStream, Published, WeightsGuard
from fedtrain.coordinator.model.published_file import PublishedFile
from fedtrain.coordinator.model.restore import load_version, newest_intact, restore_record
from fedtrain.coordinator.model.slices import SliceStream, parse_rows
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import MergeError, Refused, StateError
from fedtrain.merge import OuterOptimizer, RunningSum
from fedtrain.privacy.central import add_noise_to_sum, noise_generator, rounds_in
from fedtrain.wire import EncodedBody, parse_digest
from fedtrain.wire.delta import download_codec


def model_meta(cfg: RunConfig, algorithm: str, version: int,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A version's metadata (in the served body and its checkpoint); `extra`: the privacy record."""
    return {"run": cfg.name, "algorithm": algorithm, "version": str(version), **(extra or {})}


log = logging.getLogger(__name__)


class Committer:
    """The run's global model and every durable change to it."""

    def __init__(self, ckpt: CheckpointDir, store: Store, events: Events, fold_lock: threading.Lock) -> None:
        self.ckpt = ckpt
        self._store = store
        self._events = events
        self._fold_lock = fold_lock  # the intake's: a config change must not swap the optimizer mid-fold
        self.weights = WeightsGuard()
        self.outer: OuterOptimizer | None = None  # set by `create` or `load`
        self.published: Published | None = None  # the version served from memory
        self.committed_version = 0
        self.downloads = DownloadsInFlight()  # by participant, for the status
        self.deltas = DownloadDeltas()  # compressed downloads: the codec, the residual
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-prune")

    @property
    def model(self) -> OuterOptimizer:
        assert self.outer is not None, "the committer has no model before create() or load()"
        return self.outer

    # -- at the start ---------------------------------------------------------------------------

    def create(self, params: dict[str, torch.Tensor], cfg: RunConfig) -> str:
        """A new run: version 0 is `params`, written durably; returns its digest."""
        self.outer = OuterOptimizer(params, *outer_choice(cfg))
        self.deltas.configure(download_codec(cfg.train))
        body = EncodedBody(self.outer.params, model_meta(cfg, self.outer.algorithm, 0), digest_algorithm=cfg.digest)
        return self.write_checkpoint(0, self.outer, body)

    def load(self, version: int, cfg: RunConfig, recover: bool) -> int:
        """The last committed version, loaded and verified. If its files are damaged on disk, a
        clear refusal naming the newest intact kept version, or with `recover` that version
        committed again as `version + 1` (recorded as an event). Returns the version the run
        resumes at."""
        self.deltas.configure(download_codec(cfg.train))
        try:
            self.outer = load_version(self.ckpt, self._store, version)
            self.committed_version = version
            self._load_residual(version)
            return version
        except StateError as e:
            damaged = e.message
        found = newest_intact(self.ckpt, self._store, below=version)
        if found is None:
            raise StateError(f"{damaged}; no older kept checkpoint verifies either: restore the state directory "
                             "from a backup")
        intact, outer = found
        self.outer = outer
        if not recover:
            raise StateError(f"{damaged}. The newest intact kept version is {intact}: restart with --recover to "
                             f"resume from it (rounds {intact}..{version - 1} are lost and trained again), or put "
                             "the damaged file back from a backup")
        reason = f"recovered from version {intact} at the restart: {damaged}"
        self.commit_restored(version, outer, reason, cfg, time.time())
        self.committed_version = version + 1
        self._store.add_event("recover", f"{reason}; resumed at round {version + 1} with the weights of version "
                                         f"{intact} (--recover)")
        return version + 1

    def _load_residual(self, version: int) -> None:
        """The compressed downloads' residual of `version` (none kept: E = 0, which only costs the
        signal it held back: the weights are what was sent, bit-identical, either way)."""
        if not self.deltas.on:
            return
        residual = self.ckpt.load_residual(version)
        self.deltas.load(residual)
        if residual is None and version > 0:
            self._events.record("config", f"compressed downloads resume at version {version} without the residual "
                                          "of the ones before (none kept): it starts again from zero")

    def reconfigure(self, cfg: RunConfig, locked: bool = False) -> None:
        """Make the outer optimizer match `cfg` (`outer_choice`): a new algorithm starts with fresh
        state, but for the momentum carried between DiLoCo's step and asynchronous mode's delayed
        one (`OuterOptimizer.switched`); new hyperparameters keep the state where it still fits.
        Takes the fold lock unless `locked`."""
        if not locked:
            with self._fold_lock:
                self.reconfigure(cfg, locked=True)
            return
        if self.deltas.configure(download_codec(cfg.train)):
            self._events.record("config", "compressed downloads off: the residual they held back is dropped")
        outer = self.model
        want_alg, want_hp = outer_choice(cfg)
        if outer.algorithm == want_alg and outer.hp == want_hp:
            return
        if outer.algorithm != want_alg:
            self.outer = outer.switched(want_alg, want_hp)
            kept = "its momentum kept" if self.outer.steps else "fresh state"
            self._events.record("config", f"outer optimizer switched to {want_alg} with {kept}")
            return
        meta = {**outer.state_metadata(), "hp": json.dumps(want_hp)}
        try:
            self.outer = OuterOptimizer.restore(outer.params, outer.state_tensors(), meta)
        except MergeError:
            self.outer = OuterOptimizer(outer.params, want_alg, want_hp)
            self._events.record("config", f"outer optimizer state reset: the new {want_alg} settings need other state")

    # -- a round (worker threads) -----------------------------------------------------------------

    def step(self, acc: RunningSum, scale: float = 1.0, every: int | None = None,
             names: Collection[str] | None = None, noise_std: float = 0.0) -> None:
        """The outer step with the round's mean (the caller holds the fold lock), times `scale`
        (asynchronous mode's staleness weight, in (0, 1]); `every`: the delayed Nesterov step's
        N; `names`: the parameters it moves (a Streaming DiLoCo fragment; None: all). The sum is
        finite by construction (`RunningSum`): only the result is checked (NonFiniteStep).
        `noise_std`: central DP's N(0, noise_std²) added to each coordinate of the mean (the sum
        holds the fragment's tensors only), drawn from a generator seeded from the OS CSPRNG."""
        total, divisor = acc.scaled()
        if noise_std > 0:
            device = next(iter(total.values())).device
            add_noise_to_sum(total, divisor, noise_std, noise_generator(device))
        if scale != 1.0:
            if not (0.0 < scale <= 1.0):
                raise MergeError(f"the staleness scale must be in (0, 1], got {scale!r}")
            divisor = divisor / scale
        # Compressed downloads: P_r, kept through the step for the delta that defines P_{r+1}
        # (`deltas.py`): read back from its file, or copied (read only here, off the lock: only
        # this thread changes the weights).
        kept = self._published_file(names) if self.deltas.on else None
        try:
            prev = self.deltas.before_step(self.model.params, names, kept)
            with self.weights.lock:
                self.weights.epoch += 1
                self.model.step(total, divisor, finite=True, every=every, names=names)
            if prev is not None:
                # Off the lock (seconds at 100M parameters): the epoch moved on above, before the
                # step touched the weights, and every reader of them checks it under the lock
                # before each copy (`memory_steps`, `SliceStream`), so none reads them until `publish`.
                self.deltas.encode(prev, self.model.params)
        finally:
            if kept is not None:
                kept.close()

    def _published_file(self, names: Collection[str] | None) -> PublishedFile | None:
        """P_r from the committed version's model file (the weights in force are that version's:
        the merge waited for its commit), verified; None (logged) when it cannot serve."""
        v = self.committed_version
        published = self.published
        digest = self._store.get_meta(f"digest/{v}")
        if digest is None or (published is not None and published.version != v):
            log.info("compressed downloads: version %d is not the committed one on disk: P_r copied in memory", v)
            return None
        try:
            return PublishedFile(self.ckpt, v, digest, self.model.params, names)
        except StateError as e:
            log.warning("compressed downloads: P_r copied in memory (%s)", e.message)
            return None

    def publish(self, version: int, cfg: RunConfig, hold: bool, extra: Mapping[str, str] | None = None) -> Published:
        """A body over the new weights, to serve from memory once the caller puts it in force
        (`serve`); downloads hold back its end until it is committed when `hold`. `extra`: more
        metadata for the body and its checkpoint (the privacy record)."""
        outer = self.model
        body = EncodedBody(outer.params, model_meta(cfg, outer.algorithm, version, extra),
                           digest_algorithm=cfg.digest)
        published = Published(version, body.digest(), body, self.weights.epoch, hold=hold)
        published.delta = self.deltas.publish(published)
        return published

    def serve(self, published: Published | None) -> None:
        """Event loop: serve `published` from memory from now on (None: from the files)."""
        self.published = published

    def commit(self, r: int, record: dict[str, Any], published: Published, outer: OuterOptimizer,
               keep: int) -> None:
        """Make round r durable: checkpoint files (fsync'd), then the database row. The model
        file holds the served body's bytes, which are not hashed again (a restart checks the
        file against the served digest); the optimizer state is the one that made them. The
        caller marks it committed (`committed`) on the event loop."""
        t0 = time.perf_counter()
        weights = record.pop("weights")
        if published.delta is not None:  # before the model file: a version's file means its residual is there
            self.ckpt.write_residual(r + 1, published.delta.residual, published.body.digest_algorithm)
        record["digest"] = self.write_checkpoint(r + 1, outer, published.body)
        faults.hit("checkpoint.after_global_write", round=r)
        record["commit_s"] = time.perf_counter() - t0
        faults.hit("commit.before_db", round=r)
        self._store.commit_round(record, weights)
        faults.hit("commit.after_db", round=r)
        # Unlinking old files (freeing their blocks, and pages a download cached) takes time: off the round trip.
        self._janitor.submit(self.ckpt.prune, r + 1, keep, orphans=False)

    def committed(self, version: int) -> None:
        """Event loop: `version` is durable."""
        self.committed_version = version

    def write_checkpoint(self, version: int, outer: OuterOptimizer, body: EncodedBody) -> str:
        """Both files of `version`: the model file holds `body` (the weights of `outer`, as
        served: same metadata and digest algorithm, and its digest is not computed again when
        known), the other `outer`'s state. Returns the model file's digest. Tensors that could
        not go to the disk straight from memory are then moved to where they can."""
        written = self.ckpt.write(
            version, outer.params, outer.state_tensors(), outer.state_metadata(), body.metadata,
            body.digest_algorithm, digest=body.known_digest,
        )
        # Only the optimizer in force is moved: one replaced meanwhile by a config change may
        # share its state with the new one (`reconfigure`), which its move would destroy. The
        # fold lock keeps such a change from coming in during the move.
        if written.misfits or written.state_misfits:
            with self._fold_lock, self.weights.lock:
                if outer is self.outer:
                    self.ckpt.realign(outer, written)
        return written.digest

    def commit_restored(self, r: int, outer: OuterOptimizer, reason: str, cfg: RunConfig, opened_at: float,
                        extra: Mapping[str, str] | None = None) -> None:
        """Close round r with no updates and commit `outer` (a kept version's) as version r + 1
        (`extra`: the privacy record, carried on)."""
        self._store.discard_uncommitted(r)
        body = EncodedBody(outer.params, model_meta(cfg, outer.algorithm, r + 1, extra), digest_algorithm=cfg.digest)
        record = restore_record(r, opened_at, reason, outer.algorithm)
        record["digest"] = self.write_checkpoint(r + 1, outer, body)
        self._store.commit_round(record, {})

    def reload(self, version: int, keep: int) -> None:
        """Back to committed `version`: its weights and optimizer state (the caller holds the
        fold lock and empties the sum); its uncommitted submissions go."""
        params = self.ckpt.load_global(version, self._store.get_meta(f"digest/{version}"))
        tensors, meta = self.ckpt.load_outer(version)
        with self.weights.lock:
            self.weights.epoch += 1
            self.outer = OuterOptimizer.restore(params, tensors, meta)
        self.deltas.reset()
        self._load_residual(version)
        self._store.discard_uncommitted(version)
        self.ckpt.prune(version, keep)

    def restore(self, version: int) -> None:
        """Put kept `version`'s weights and optimizer state in force (the caller holds the fold
        lock, and served nothing from memory first: `serve(None)`)."""
        outer = load_version(self.ckpt, self._store, version)
        with self.weights.lock:
            self.weights.epoch += 1
            self.outer = outer
        self.deltas.reset()  # the kept version is committed again whole: its residual is not ours

    # -- reading (event loop) ---------------------------------------------------------------------

    def privacy_rounds(self) -> int:
        """The rounds merged with DP noise up to the committed version, as its metadata records
        them; a version that records none (written before DP, or by --recover) counts every
        version as one such round: more, never fewer, than the truth."""
        done = rounds_in(self.ckpt.run_metadata(self.committed_version))
        return self.committed_version if done is None else done

    def kept_versions(self) -> list[int]:
        """The committed versions whose checkpoint files are kept, newest first."""
        return sorted((v for v in self.ckpt.versions() if v <= self.committed_version), reverse=True)

    def model_stream(self, v: int) -> ModelStream:
        """A download of global version `v`: from memory while it is the published version
        (being committed, or committed and not yet stepped past), else from its committed file."""
        path = self.ckpt.global_path(v)
        published = self.published if self.published is not None and self.published.version == v else None
        if published is not None:
            stream = ModelStream(v, published.digest, published.body.content_length, path, self.ckpt, published,
                                 self.weights)
        else:
            digest = self._committed_digest(v)
            try:
                stream = ModelStream(v, digest, path.stat().st_size, path, self.ckpt)
            except FileNotFoundError:  # pruned a moment ago
                raise self._not_kept(v) from None
        return stream

    def delta_stream(self, newest: int, from_version: int) -> DeltaStream:
        """A download of the compressed delta from `from_version` to the newest version `newest`
        (from memory); 404 when downloads go whole in this run, 409 when `from_version` is not
        the version before `newest` or the newest has no delta (served from its file: after a
        restart or a roll back): the participant then downloads the model whole."""
        if not self.deltas.on:
            raise Refused(404, "no_delta", "this run sends the model whole (train.download_compression none)")
        published = self.published
        delta = published.delta if published is not None and published.version == newest else None
        if delta is None or delta.from_version != from_version:
            raise Refused(409, "delta_unavailable", f"no compressed delta from version {from_version} to the newest "
                          f"version {newest} (one exists only from the version just before it, while it is served "
                          "from memory): download the model whole", {"version": newest, "from": from_version})
        return DeltaStream(delta)

    async def model_slice(self, v: int, rows: str) -> SliceStream:
        """A download of the rows `rows` (a JSON query, `slices.parse_rows`) of global version
        `v`, from the same source `model_stream` would take; read and hashed on a worker thread."""
        wanted = parse_rows(rows, self.spec())
        path = self.ckpt.global_path(v)
        published = self.published if self.published is not None and self.published.version == v else None
        if published is not None:
            stream = SliceStream(v, wanted, path, self.ckpt, memory=published, guard=self.weights,
                                 params=self.model.params)
        else:
            algorithm = parse_digest(self._committed_digest(v))[0]
            try:
                stream = SliceStream(v, wanted, path, self.ckpt, digest_algorithm=algorithm)
            except FileNotFoundError:  # pruned a moment ago
                raise self._not_kept(v) from None
        try:
            await asyncio.to_thread(stream.prepare)
        except BaseException:
            stream.close()
            raise
        return stream

    def _committed_digest(self, v: int) -> str:
        """The digest of committed version `v`'s file; 404 when it is not kept."""
        digest = self._store.get_meta(f"digest/{v}")
        if v > self.committed_version or digest is None:
            raise self._not_kept(v)
        return digest

    def _not_kept(self, v: int) -> Refused:
        kept = [x for x in self.ckpt.versions() if x <= self.committed_version]
        return Refused(404, "version_not_kept", f"global model version {v} is not available (kept: {kept})")

    def spec(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (t.dtype, tuple(t.shape)) for n, t in self.model.params.items()}

    def params(self) -> Mapping[str, torch.Tensor]:
        return self.model.params

    def stop(self) -> None:
        self._janitor.shutdown(wait=True)
