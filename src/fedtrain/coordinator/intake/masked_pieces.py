"""Masked updates in pieces: an FSDP group under secure aggregation sends its update as its ranks'
pieces, each a flat element range of every synced tensor's ring values, masked on that rank.

`MaskedPieces` owns those pieces while they come in: each is checked (the attempt's session, the
ring's dtype, no compression, element ranges inside the tensors, disjoint from the pieces in)
and spooled; once a participant's pieces cover the round's tensors they are assembled into one
masked body over the attempt's ring spec (`pieces.assemble`: one flat uint16/uint32 tensor per
synced tensor) and folded into the attempt's ring sum. Nothing is folded before that: an update
still incomplete at the close is never in the sum, so it counts as dropped and the survivors'
shares remove its masks, as for any dropout. The coordinator never holds an unmasked piece:
each one's values are noise to it. Event loop, except the assembly and the fold (worker threads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from fedtrain.coordinator.intake.landing import SpoolLanding
from fedtrain.coordinator.intake.pieces import MAX_PIECES, Coverage, Partial, PiecesIn, assemble, piece_rows
from fedtrain.coordinator.intake.spool import SpoolFiles
from fedtrain.coordinator.intake.tickets import FoldsInFlight, PieceAnswer, Seats, Ticket, Upload
from fedtrain.coordinator.secagg import SecureAggregation
from fedtrain.coordinator.secagg.attempt import Attempt
from fedtrain.errors import Refused, WireError
from fedtrain.privacy.failures import PrivacyError
from fedtrain.transport import Body
from fedtrain.wire import TensorSpec
from fedtrain.wire.compress import scheme_of

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def ring_spec(attempt: Attempt) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The attempt's masked body, as a spec: one flat tensor of ring values per synced tensor."""
    assert attempt.setup is not None  # (an attempt admits uploads in its upload phase only)
    dtype = torch.uint16 if attempt.setup.fixed_point.bits == 16 else torch.uint32
    return {name: (dtype, (int(torch.Size(shape).numel()),)) for name, shape in attempt.shapes.items()}


async def fold_masked(attempt: Attempt, up: Upload, path: Path, seats: Seats,
                      in_flight: FoldsInFlight) -> Ticket | None:
    """A verified masked body (a spool file: a whole upload, or an FSDP group's assembled pieces)
    given its place in the open round and added to the attempt's ring sum on a worker thread, a
    fold in flight meanwhile; its ticket (None: a duplicate). The place goes back if the fold fails."""
    ticket = seats.reserve(up)
    if ticket is None:
        return None
    in_flight.enter()
    try:
        await asyncio.to_thread(attempt.fold, up.pid, path)
    except PrivacyError as e:
        ticket.release()
        raise Refused(409, "secagg_upload", e.args[0]) from None
    except BaseException:
        ticket.release()
        raise
    finally:
        in_flight.leave()
    return ticket


class MaskedPieces:
    """The open round's masked updates still in pieces, by (participant, round, session)."""

    def __init__(self, spool_files: SpoolFiles, in_flight: FoldsInFlight, landing: SpoolLanding) -> None:
        self._spool_files = spool_files
        self._in_flight = in_flight  # (the close waits for every fold in flight: `Intake.idle`)
        self._landing = landing  # (a piece lands verified in a spool file: `landing.py`)
        self._partials: dict[tuple[str, int, str], Partial] = {}
        self._busy: dict[tuple[str, int, str], Partial] = {}  # complete: being assembled and folded
        self._folded: dict[tuple[str, int, str], PiecesIn] = {}

    async def receive(self, masked: SecureAggregation, up: Upload, label: str, body: Body,
                      seats: Seats) -> PieceAnswer:
        """Admit, check, spool one masked piece; fold the update once its pieces cover the round's
        tensors. Raises Refused (4xx) with nothing changed for a piece that cannot count."""
        try:
            attempt = masked.admit(up.pid, up.round, up.tokens)
            key = (up.pid, up.round, attempt.session)
            answer = self._known(key, label, up)
        except Refused:
            await body.drain()
            raise
        if answer is not None:
            await body.drain()
            return answer
        ring = ring_spec(attempt)
        rows: dict[str, tuple[int, int]] = {}

        def on_header(specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
            attempt.check_session_meta(metadata)
            if scheme_of(metadata)[0] != "none":
                raise WireError("a masked piece holds ring values as they are: it cannot be compressed")
            rows.update(piece_rows(specs, metadata, ring))

        landed = await self._landing.land(up, body, on_header)
        path, new = landed.path, landed.new
        assert path is not None
        owned = False
        try:
            if self._known(key, label, up) is not None:  # the same piece came in meanwhile
                raise Refused(409, "piece_conflict", f"piece {label!r} of {up.pid}'s update came in twice at once")
            partial = self._partials.get(key) or Partial(up.tokens, Coverage(ring))
            partial.take(label, rows, path, up.digest, up.length)  # (409 piece_overlaps: nothing taken)
            self._partials[key] = partial
            owned = True
        finally:
            if not owned:
                self._spool_files.discard(path, new)
        if not partial.coverage.complete:
            return PieceAnswer.so_far(len(partial.pieces), partial.coverage.missing(), partial.length, partial.digest())
        del self._partials[key]
        self._busy[key] = partial
        try:
            ticket = await self._fold(attempt, up, partial, ring, seats)
        finally:
            del self._busy[key]
        if ticket is not None:
            self._folded[key] = PiecesIn.of(partial)
        return PieceAnswer(ticket, True, ticket is None, len(partial.pieces), [], partial.length, partial.digest())

    def _known(self, key: tuple[str, int, str], label: str, up: Upload) -> PieceAnswer | None:
        """The answer for a piece that came before (or an update already folded), None for a new
        one; Refused for one that cannot be taken (other bytes under its label, one too many)."""
        done = self._busy.get(key)
        if done is not None or key in self._folded:
            n = len(done.pieces) if done is not None else len(self._folded[key].labels)
            return PieceAnswer(None, False, True, n, [], done.length if done is not None else 0, "")
        partial = self._partials.get(key)
        if partial is None:
            return None
        if label in partial.pieces:
            if partial.pieces[label].digest != up.digest:
                raise Refused(409, "piece_conflict", f"piece {label!r} of {up.pid}'s update for round {up.round} "
                              "came before with other bytes")
            return PieceAnswer(None, False, True, len(partial.pieces), partial.coverage.missing(), partial.length,
                               "")
        if len(partial.pieces) >= MAX_PIECES:
            raise Refused(400, "too_many_pieces", f"{up.pid}'s masked update for round {up.round} has "
                          f"{len(partial.pieces)} pieces in already, the most one update may come in ({MAX_PIECES})")
        if partial.tokens != up.tokens:
            raise Refused(400, "piece_mismatch", f"piece {label!r} claims {up.tokens} tokens, the pieces before it "
                          f"{partial.tokens}: every piece of an update carries the update's token count")
        return None

    async def _fold(self, attempt: Attempt, up: Upload, partial: Partial, ring: Spec, seats: Seats) -> Ticket | None:
        """The complete pieces as one masked body (a spool file), into the attempt's ring sum."""
        whole, whole_new = self._spool_files.take()
        try:
            try:
                await asyncio.to_thread(assemble, partial, ring, whole)
            finally:
                for piece in partial.pieces.values():
                    self._spool_files.give_back(piece.path)
            return await fold_masked(attempt, up, whole, seats, self._in_flight)
        finally:
            self._spool_files.discard(whole, whole_new)

    # -- what the intake asks (`flow.py`) ------------------------------------------------------------

    def has_piece(self, pid: str, round_: int, label: str) -> bool:
        """Whether piece `label` of `pid`'s update is in (its update folded counts as in)."""
        folded = (done for k, done in self._folded.items() if k[:2] == (pid, round_))
        return any(label in done.labels for done in folded) or any(
            k[:2] == (pid, round_) and label in p.pieces for k, p in (*self._partials.items(), *self._busy.items()))

    def pieces_in(self, round_: int) -> dict[str, PiecesIn]:
        out = {k[0]: PiecesIn.of(p) for k, p in self._partials.items() if k[1] == round_}
        out.update({pid: done for (pid, r, _), done in self._folded.items() if r == round_})
        return out

    def drop(self, keep: Callable[[tuple[str, int, str]], bool]) -> list[tuple[int, int]]:
        """Forget the incomplete updates `keep` does not keep; (round, pieces) of each dropped."""
        dropped = []
        for key in [k for k in self._partials if not keep(k)]:
            partial = self._partials.pop(key)
            for piece in partial.pieces.values():
                self._spool_files.give_back(piece.path)
            dropped.append((key[1], len(partial.pieces)))
        return dropped

    def clear(self) -> None:
        """The round is over: incomplete updates go (never in the sum: they were dropouts)."""
        self.drop(lambda _: False)
        self._folded.clear()
