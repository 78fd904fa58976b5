"""The intake's one flow for the open round's updates: receive and verify each, then place it.

`Intake` owns the spool files uploads stream into, the one upload being received straight
into the sum, the folds in flight (with a wait for none, `idle`), updates still in pieces,
and why the open round cannot be merged. Where an upload goes is the policy's decision.

More: docs/architecture.md, "coordinator/intake/flow.py".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import policy
from fedtrain.coordinator.intake import pieces
from fedtrain.coordinator.intake.attempts import Attempts
from fedtrain.coordinator.intake.direct_sum import DirectUpload
from fedtrain.coordinator.intake.folds import MergeInputs, Pending, RoundSum
from fedtrain.coordinator.intake.landing import Landed, Landing, SpoolLanding, SumLanding
from fedtrain.coordinator.intake.masked_pieces import MaskedPieces, fold_masked
from fedtrain.coordinator.intake.parts import PartSessions
from fedtrain.coordinator.intake.pieces import (
    ROWS_META,
    Coverage,
    Partial,
    PiecesIn,
    assemble,
    check_label,
    piece_rows,
)
from fedtrain.coordinator.intake.receive import Head
from fedtrain.coordinator.intake.spool import SpoolFiles, Staging
from fedtrain.coordinator.intake.tickets import FoldsInFlight, PieceAnswer, Seats, Ticket, Upload
from fedtrain.coordinator.intake.values import ValueScan
from fedtrain.coordinator.rounds.fragment_plan import Fragment, check_fragment
from fedtrain.coordinator.secagg import SecureAggregation
from fedtrain.errors import MergeError, Refused, WireError
from fedtrain.merge import RunningSum, check_compatible
from fedtrain.merge.robust import clip_scale
from fedtrain.transport import Body, fast_io_enabled
from fedtrain.transport.progress import Progress
from fedtrain.wire import TensorSpec
from fedtrain.wire.compress import codec_of, expected_specs, fit_specs, scheme_of

log = logging.getLogger("fedtrain.coordinator")

#: `FEDTRAIN_DIRECT_RECEIVE=0` turns off the receive into the sum alone (every upload lands in
#: a spool file), the other fast IO paths staying on: what `benchmarks/sync_throughput.py
#: --direct-compare` measures the receive into the sum by (docs/benchmarks.md).
DIRECT_RECEIVE_ENV = "FEDTRAIN_DIRECT_RECEIVE"

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


class Intake:
    """The open round's updates: received, verified, then folded or kept (`RoundSum`)."""

    def __init__(self, spool_dir: Path, spec: Spec, params: Mapping[str, torch.Tensor],
                 fold_lock: threading.Lock | None = None, fast_io: bool | None = None) -> None:
        self._model = spec  # every tensor of the sync set
        self._spec = spec  # those the open round takes: the model's, or its fragment's (`select`)
        self._fragment: Fragment | None = None
        self._fast_io = fast_io_enabled(fast_io)  # off: no upload is received straight into the sum
        self._direct_on = os.environ.get(DIRECT_RECEIVE_ENV, "").strip() != "0"
        self.round = RoundSum(spool_dir, spec, params, fold_lock or threading.Lock())
        self._spool_files = SpoolFiles(spool_dir)
        self.parts = PartSessions(self._spool_files)  # updates coming in as parts (`parts.py`)
        self.attempts = Attempts()  # the upload attempts in progress: a newer takes over (`attempts.py`)
        self.transfers: dict[str, Progress] = {}  # participant -> its whole upload streaming in now
        self._to_spool = SpoolLanding(self._spool_files)  # the two sinks an upload lands in (`landing.py`)
        self._to_sum = SumLanding(lambda: self.round.storage)
        self._in_flight = FoldsInFlight()
        self._deferred: set[asyncio.Task[None]] = set()
        self._failure: str | None = None  # a fold failed: the open round cannot be merged
        self._partials: dict[tuple[str, int], Partial] = {}  # (participant, round) -> its pieces so far
        self._assembling: dict[tuple[str, int], Partial] = {}  # complete, until placed in the round
        self._assembled: dict[tuple[str, int], PiecesIn] = {}  # updates of the round made whole from pieces
        self._streaming: dict[tuple[str, int], dict[str, int]] = {}  # (participant, round) -> label -> bytes
        self.last_path: policy.ReceivePath | None = None  # where the latest upload went, and why
        self.masked: SecureAggregation | None = None  # secure aggregation: uploads are masked (`_receive_masked`)
        self.masked_pieces = MaskedPieces(self._spool_files, self._in_flight, self._to_spool)  # (FSDP groups)

    # -- what others may read ---------------------------------------------------------------

    @property
    def sum(self) -> RunningSum:
        """The open round's running sum (change it only under `fold_lock`)."""
        return self.round.acc

    @property
    def fold_lock(self) -> threading.Lock:
        return self.round.lock

    @property
    def receiving_direct(self) -> str | None:
        """The participant whose upload is being received straight into the sum, if any."""
        return self._to_sum.pid

    @property
    def folds_in_flight(self) -> int:
        return self._in_flight.count

    @property
    def failure(self) -> str | None:
        """Why the open round cannot be merged (a fold of an accepted update failed), or None."""
        return self._failure

    def fail(self, why: str) -> None:
        """The open round cannot be merged: an accepted update is not in the sum."""
        self._failure = why

    def pieces_in(self, round_: int) -> dict[str, PiecesIn]:
        """The updates for `round_` that come in pieces, by participant: those still coming
        in (the labels so far, the share of the sync set they hold) and those made whole."""
        out = {pid: PiecesIn.of(partial) for (pid, r), partial in self._partials.items() if r == round_}
        out.update({pid: done for (pid, r), done in self._assembled.items() if r == round_})
        out.update(self.masked_pieces.pieces_in(round_))
        return out

    def transfer_view(self, pid: str) -> dict[str, object] | None:
        """`pid`'s upload in flight as a status shows it (`Progress.view`, `direction` "up",
        `connections`: how many carry it now): a whole body streaming in, else its upload in
        parts; None: none. (`DownloadsInFlight.add_to` puts it in the participant's `transfers`.)"""
        progress, connections = self.transfers.get(pid), 1
        if progress is None:
            session = next((s for s in self.parts.of(pid) if s.progress is not None), None)
            if session is not None:
                progress, connections = session.progress, len(session.streaming)
        if progress is None:
            return None
        return {**progress.view(), "direction": "up", "connections": connections}

    def barred(self, round_: int, pid: str) -> str | None:
        """Why `pid`'s update for `round_` is refused (its merge was not finite), or None."""
        return self.round.barred(round_, pid)

    def bar(self, round_: int, pid: str, why: str) -> None:
        self.round.bar(round_, pid, why)

    def set_piece_bytes(self, nbytes: int) -> None:
        """Read spool files back in pieces of at most `nbytes` (tests use small pieces)."""
        self.round.staging = Staging(nbytes)

    def select(self, fragment: Fragment | None) -> None:
        """From now on the open round takes the tensors of `fragment` only (Streaming DiLoCo;
        None: the whole sync set). At a round boundary: the sum empty, no fold in flight. (A
        body of the round before may still be streaming into the sum's memory: it is refused
        when it asks for its place, and never counted.)"""
        if self._in_flight.count:
            raise MergeError("the tensors a round takes change only at a round boundary, with no fold in flight")
        self._fragment = fragment
        self._spec = self._model if fragment is None else {n: self._model[n] for n in fragment.names}
        self.round.select(None if fragment is None else fragment.names)

    async def idle(self) -> None:
        """Wait until no fold is in flight (the folds beside a direct receive included)."""
        await self._in_flight.wait_none()

    def merge_inputs(self, cfg: RunConfig) -> MergeInputs:
        """At the close, on a worker thread holding the fold lock, no fold in flight: the
        whole round in the sum (`RoundSum.merge_inputs`)."""
        return self.round.merge_inputs(cfg, self._failure)

    # -- receiving ------------------------------------------------------------------------------

    async def receive(self, up: Upload, body: Body, head: Head | None, action: str, cfg: RunConfig,
                      active: int, seats: Seats, may_reach: Callable[[], int]) -> Ticket | None:
        """Receive, verify, check and fold (or keep) one upload admitted as `action`
        (`policy.admit_upload`), with `active` participants; its ticket, None for a duplicate.
        Raises Refused for a bad body or values, or a round that closed meanwhile.

        One flow for every upload: the policy picks where its bytes land (`policy.receive_path`:
        the empty sum's memory, or a spool file), they land there verified through that sink
        (`landing.py`), then the upload is placed in the round (`_place`). With secure
        aggregation every upload is a masked body, which goes to the ring sum (`_receive_masked`)."""
        if self.masked is not None:
            return await self._receive_masked(self.masked, up, body, seats)
        plain = head is not None and scheme_of(head[1])[0] == "none"
        empty = not self._to_sum.busy and not self._in_flight.count and self.round.is_empty()
        fast = self._fast_io and self._direct_on
        path = policy.receive_path(fast_io=fast, action=action, sum_empty=empty, active=active,
                                   plain=plain, fits=head is not None and self.round.fits(head[0]), cfg=cfg)
        self.last_path = path
        try:
            sink: Landing = self._to_sum if path.path == "direct" else self._to_spool
            landed = await sink.land(up, body, self.check_header, lambda: seats.refusal(up))
            return await self._place(up, landed, cfg, seats, may_reach)
        finally:
            self._give_back_freed()

    async def _receive_masked(self, masked: SecureAggregation, up: Upload, body: Body, seats: Seats) -> Ticket | None:
        """A masked upload (secure aggregation): admitted by its attempt, landed in a spool file
        (header: the ring's dtype, flat tensors, the session), given its place, then added to the
        attempt's ring sum on a worker thread. Its values cannot be checked: they are uniform noise
        to the coordinator (docs/privacy.md, "What is lost")."""
        try:
            attempt = masked.admit(up.pid, up.round, up.tokens)
        except Refused:
            await body.drain()
            raise
        landed = await self._to_spool.land(up, body, attempt.check_header)
        assert landed.path is not None
        try:
            return await fold_masked(attempt, up, landed.path, seats, self._in_flight)
        finally:
            self._spool_files.discard(landed.path, landed.new)

    def check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        if ROWS_META in metadata:
            raise WireError(f"a body with {ROWS_META} in its metadata is a piece of an update: send it with "
                            "?piece=<label>")
        codec = codec_of(metadata)  # compressed deltas carry their scheme in the header
        if self._fragment is not None:
            check_fragment(self._fragment, self._model, specs, whole=True)
        want = expected_specs(dict(self._spec), codec)
        check_compatible(want, fit_specs(want, {n: (s.dtype, s.shape) for n, s in specs.items()}, codec),
                         what="update")

    async def _count_in_sum(self, up: Upload, direct: DirectUpload, scan: ValueScan | None,
                            seats: Seats) -> Ticket | None:
        """Count an upload that landed in the sum with its weight, once it has its place."""
        try:
            ticket = seats.reserve(up)
            if ticket is None:
                return None
            self._in_flight.enter()
            try:
                await asyncio.to_thread(self.round.take_direct, ticket.key, ticket.weight, scan)
            except BaseException:
                ticket.release()
                raise
            finally:
                self._in_flight.leave()
            return ticket
        finally:  # what was written but not taken is no contribution: the sum stays empty
            self._to_sum.release(direct)

    def abort_direct(self, pid: str | None = None) -> None:
        """The round is closing (or `pid`, the uploader, failed or left): an upload still
        streaming into the sum stops and gives the sum up (`SumLanding.abort`). One already
        received is a fold in flight, which the close waits for (`idle`)."""
        self._to_sum.abort(pid)

    async def _place(self, up: Upload, landed: Landed, cfg: RunConfig, seats: Seats,
                     may_reach: Callable[[], int]) -> Ticket | None:
        """Place a verified upload in the open round. Landed in the sum: counted there
        (`RoundSum.take_direct`). In a spool file: its values checked and placed as
        `policy.place_update` says (folded now, kept until the close, or folded after the
        upload being received into the sum)."""
        if landed.direct is not None:
            return await self._count_in_sum(up, landed.direct, landed.scan, seats)
        assert landed.path is not None
        path, new = landed.path, landed.new
        owned = False  # the round owns the file now (`RoundSum`, or a deferred fold)
        try:
            place = policy.place_update(cfg, self._to_sum.busy)
            largest: float | None = None
            if place.check_first:
                largest = await asyncio.to_thread(self.round.check_values, path)
            norm = await asyncio.to_thread(self.round.norm, path, cfg)
            if place.action != "fold_after":
                await self._to_sum.finished()  # (none is in progress then: a safeguard)
                await seats.wait_seat(up)
            ticket = seats.reserve(up)  # the round may have closed while the body streamed in
            if ticket is None:
                return None
            scale = clip_scale(norm, cfg.outer.clip_norm) if place.action != "fold_after" else 1.0
            pending = Pending(ticket.key, may_reach(), cfg.outer.max_share, scale, largest)
            self._in_flight.enter()
            if place.action == "fold_after":
                self._fold_later(path, ticket.weight, pending, may_reach)
                owned = True
                return ticket
            try:
                if place.action == "keep":
                    assert largest is not None
                    self.round.keep(ticket.key, path, ticket.open_round, ticket.weight, norm, largest)
                else:
                    failure = await asyncio.to_thread(self.round.check_and_fold, path, ticket.weight, pending)
                    if failure is not None:
                        self._failure = failure
            except BaseException:
                ticket.release()
                raise
            finally:
                self._in_flight.leave()
            owned = True
            return ticket
        finally:
            if not owned:
                self._spool_files.discard(path, new)

    # -- updates in pieces ----------------------------------------------------------------------

    async def receive_piece(self, up: Upload, label: str, body: Body, cfg: RunConfig, seats: Seats,
                            may_reach: Callable[[], int]) -> PieceAnswer:
        """Receive and verify one piece of `up.pid`'s update for the open round (`pieces.py`);
        once the pieces cover the sync set, assemble and place the update like any other."""
        if self.masked is not None:  # an FSDP group's masked pieces: folded once they cover the round's tensors
            return await self.masked_pieces.receive(self.masked, up, label, body, seats)
        key = (up.pid, up.round)
        if key in self._assembling:  # complete: its last piece is being assembled and placed
            await body.drain()
            done = self._assembling[key]
            return PieceAnswer(None, False, True, len(done.pieces), [], done.length, done.digest())
        self._check_piece_fits(key, label, up)
        known = self._partials.get(key)
        if known is not None and label in known.pieces:
            await body.drain()
            if known.pieces[label].digest != up.digest:
                raise Refused(409, "piece_conflict", f"piece {label!r} of {up.pid}'s update for round {up.round} "
                              "came before with other bytes")
            return PieceAnswer(None, False, True, len(known.pieces), known.coverage.missing(), known.length, "")
        rows: dict[str, tuple[int, int]] = {}

        def on_header(specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
            if self._fragment is not None:
                check_fragment(self._fragment, self._model, specs, whole=False)
            rows.update(piece_rows(specs, metadata, self._spec))

        landed = await self._to_spool.land(up, body, on_header)
        assert landed.path is not None
        path, new = landed.path, landed.new
        owned = False
        try:
            await asyncio.to_thread(self.round.check_values, path)  # each piece as it comes
            self._check_piece_fits(key, label, up)  # again: others came in meanwhile
            partial = self._partials.setdefault(key, Partial(up.tokens, Coverage(self._spec)))
            partial.take(label, rows, path, up.digest, up.length)
            owned = True
        finally:
            if not owned:
                self._spool_files.discard(path, new)
        if not partial.coverage.complete:
            return PieceAnswer.so_far(len(partial.pieces), partial.coverage.missing(), partial.length, partial.digest())
        del self._partials[key]
        self._assembling[key] = partial  # its pieces still count as in until the update is placed
        try:
            whole, whole_new = self._spool_files.take()
            try:
                await asyncio.to_thread(assemble, partial, self._spec, whole)
            except BaseException:
                self._spool_files.discard(whole, whole_new)
                raise
            finally:
                for piece in partial.pieces.values():
                    self._spool_files.give_back(piece.path)
            ticket = await self._place(up, Landed(whole, whole_new, None, None), cfg, seats, may_reach)
        finally:
            del self._assembling[key]
        if ticket is not None:
            self._assembled[key] = PiecesIn.of(partial)
        return PieceAnswer(ticket, True, ticket is None, len(partial.pieces), [], partial.length, partial.digest())

    def hold_piece(self, up: Upload, label: str, ranks: int | None) -> None:
        """Count piece `label` of `up` as streaming in, before a byte of it is read; refuse it
        (`pieces.room_for_piece`: 429 or 413) when its update has as many pieces streaming in
        as its participant has ranks, or its pieces would hold more bytes than the update sent
        whole may. `release_piece` once its request is over, whatever became of it."""
        key = (up.pid, up.round)
        partial = self._partials.get(key)
        streaming = self._streaming.get(key, {})
        if key in self._assembling or (partial is not None and label in partial.pieces):
            refusal = None  # complete, or a piece in already: answered without a byte spooled
        else:
            held, count = (partial.length, len(partial.pieces)) if partial is not None else (0, 0)
            refusal = pieces.room_for_piece(f"{up.pid}'s update for round {up.round}", label, up.length, held, count,
                                            streaming, ranks, up.limit, pieces.header_allowance(self._spec))
        if refusal is not None:
            raise refusal
        self._streaming.setdefault(key, {})[label] = up.length

    def release_piece(self, up: Upload, label: str) -> None:
        key = (up.pid, up.round)
        streaming = self._streaming.get(key)
        if streaming is not None:
            streaming.pop(label, None)
            if not streaming:
                del self._streaming[key]

    def drop_pieces(self, pid: str) -> list[tuple[int, int]]:
        """Forget the pieces of `pid`'s updates still incomplete (it joined again: the process
        that sent them is gone, and the new one sends its own), and its uploads in parts.
        Returns (round, pieces) dropped."""
        self.parts.drop_where(lambda k: k[0] != pid)
        dropped = []
        for key in [k for k in self._partials if k[0] == pid]:
            partial = self._partials.pop(key)
            for piece in partial.pieces.values():
                self._spool_files.give_back(piece.path)
            dropped.append((key[1], len(partial.pieces)))
        return dropped + self.masked_pieces.drop(lambda k: k[0] != pid)

    def has_piece(self, pid: str, round_: int, label: str) -> bool:
        """Whether piece `label` of `pid`'s update for `round_` is in, its update not yet placed
        in the round (complete and being assembled counts as in)."""
        partial = self._partials.get((pid, round_)) or self._assembling.get((pid, round_))
        return (partial is not None and label in partial.pieces) or self.masked_pieces.has_piece(pid, round_, label)

    def _check_piece_fits(self, key: tuple[str, int], label: str, up: Upload) -> None:
        check_label(label)
        partial = self._partials.get(key)
        if partial is not None and label not in partial.pieces and len(partial.pieces) >= pieces.MAX_PIECES:
            raise Refused(400, "too_many_pieces", f"{up.pid}'s update for round {up.round} has {len(partial.pieces)} "
                          f"pieces in already, the most one update may come in ({pieces.MAX_PIECES}), and they do "
                          "not cover it: send larger pieces")
        if partial is not None and partial.tokens != up.tokens:
            raise Refused(400, "piece_mismatch", f"piece {label!r} claims {up.tokens} tokens, the pieces before it "
                          f"{partial.tokens}: every piece of an update carries the update's token count")

    def _fold_later(self, path: Path, weight: float, pending: Pending, may_reach: Callable[[], int]) -> None:
        """Fold a checked spool file once the direct upload in the sum is counted (or stopped);
        the fold is in flight from now on. If it fails, the round cannot be merged without it
        (its participant was told it is in): the merge refuses, and the round goes back."""
        async def fold() -> None:
            placed = False
            try:
                await self._to_sum.finished()
                now = replace(pending, may_reach=may_reach())
                failure = await asyncio.to_thread(self.round.check_and_fold, path, weight, now)
                if failure is not None:
                    self._failure = failure
                placed = True
            except asyncio.CancelledError:  # shutting down: the round is not merged now
                self._failure = "the fold of an accepted upload was cancelled"
                raise
            except Exception as e:
                log.exception("a deferred fold failed")
                self._failure = f"the fold of an accepted upload failed ({e})"
            finally:
                self._in_flight.leave()
                if not placed:
                    self._spool_files.give_back(path)
                self._give_back_freed()

        task = asyncio.create_task(fold())
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)

    def _give_back_freed(self) -> None:
        """Spool files whose updates were folded (on a worker thread) go back for reuse."""
        for path in self.round.drain_freed():
            self._spool_files.give_back(path)

    # -- the end of a round (event loop) --------------------------------------------------------

    def clear(self, committed: bool, oldest_round: int) -> None:
        """The round is over (merged or gone back): kept and waiting spool files go (the caller
        empties the sum, under the fold lock), and so does any fold failure; refusals of
        rounds before `oldest_round` are forgotten once `committed` (`RoundSum.clear`)."""
        for path in self.round.clear(committed, oldest_round):
            self._spool_files.give_back(path)
        for partial in self._partials.values():  # updates still in pieces: their round is over
            for piece in partial.pieces.values():
                self._spool_files.give_back(piece.path)
        self._partials.clear()
        self._assembled.clear()
        self.masked_pieces.clear()
        self._failure = None
        self.parts.drop_where(lambda k: k[1] >= oldest_round)  # uploads in parts the run no longer takes

    async def stop(self) -> None:
        """Cancel the folds waiting for a direct upload, and the uploads in parts (shutting down)."""
        await self.parts.stop()
        for task in list(self._deferred):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down: nothing to report
                await task

