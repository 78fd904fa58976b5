"""Taking one participant's update: admit it, hand it to the intake, count it.

`Uploads` answers `POST /v1/rounds/{r}/update` and owns no state: the round's is
`OpenRound`'s, the participants' the roster's. Event loop only.

More: docs/architecture.md, "coordinator/intake/uploads.py".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fedtrain import faults
from fedtrain.coordinator import policy
from fedtrain.coordinator.intake.attempts import TAKEOVER_WAIT_S
from fedtrain.coordinator.intake.flow import Intake
from fedtrain.coordinator.intake.parts import PartClaim, Session, check_claim
from fedtrain.coordinator.intake.pieces import check_label
from fedtrain.coordinator.intake.receive import peek_header
from fedtrain.coordinator.intake.tickets import Ticket, Upload
from fedtrain.coordinator.intake.values import POISON_CODES
from fedtrain.coordinator.members import processes
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.members.roster import Roster
from fedtrain.coordinator.policy import async_rules
from fedtrain.coordinator.rounds.progress import Rounds
from fedtrain.coordinator.state import storage
from fedtrain.coordinator.state.config_versions import ConfigVersions
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.storage import storage_full
from fedtrain.coordinator.state.store import ParticipantRow, Store
from fedtrain.errors import Refused
from fedtrain.transport import Abandoned, Body
from fedtrain.transport.progress import Progress

log = logging.getLogger("fedtrain.coordinator")

#: What stops a consumer of an upload in parts short of an answer about its body: then it is
#: started again (at the next part), or the whole file read once more (`Uploads._consumed`).
RESTART_STATUSES = frozenset({409, 429, 503})


def _restart(consumer: asyncio.Task[dict[str, Any]] | None) -> bool:
    """Whether an upload in parts needs a new consumer: it has none, or its consumer ended
    without an answer about the body (stopped, or refused for a reason the body is not:
    the round closing or its participant failing meanwhile, a slot taken)."""
    if consumer is None:
        return True
    if not consumer.done():
        return False
    if consumer.cancelled():
        return True
    error = consumer.exception()
    if error is None:
        return False
    return isinstance(error, Abandoned) or (isinstance(error, Refused) and error.status in RESTART_STATUSES)


#: Asynchronous mode: how long a verified update waits for the open round to take it (below
#: the participant's read timeout of 90 s: its request is answered within it).
SEAT_WAIT_S = 60.0


class Uploads:
    """The coordinator's side of an upload, from its headers to its place in the round."""

    def __init__(self, rounds: Rounds, roster: Roster, configs: ConfigVersions, intake: Intake, store: Store,
                 events: Events) -> None:
        self._rounds = rounds
        self._roster = roster
        self._configs = configs
        self._intake = intake
        self._store = store
        self._events = events

    def check_open(self, round_: int) -> policy.Admission:
        """Admit an upload for `round_` into the open round (accept or late), or refuse with 409
        (422 for a base version below 0, 507 while a full disk holds the run back)."""
        rounds = self._rounds
        if rounds.back.storage_full_since is not None:
            raise Refused(507, "insufficient_storage", storage.MESSAGE, {"current_round": rounds.version})
        admission = rounds.open.admission(round_, rounds.finished, self._configs.config)
        if admission.action != "refuse":
            return admission
        if admission.code == "run_finished":
            raise Refused(409, "run_finished", admission.reason, {"current_round": rounds.version, "finished": True})
        if admission.code == "invalid_version":
            raise Refused(422, "invalid_version", admission.reason, {"current_round": rounds.version})
        if admission.code == "too_stale":
            raise Refused(409, "too_stale", f"{admission.reason}: download the current global model and train from it",
                          {"current_round": rounds.version, "staleness": admission.staleness})
        raise Refused(409, "round_closed", f"{admission.reason}: download the current global model and continue",
                      {"current_round": rounds.version})

    def _is_duplicate(self, pid: str, round_: int, admission: policy.Admission) -> bool:
        """Sent before: into the open round, as a late fold, or (late) already part of round_ when it closed."""
        if self._rounds.open.taken(self._rounds.open.key(pid, round_, admission)):
            return True
        if self._async and round_ < self._rounds.version:
            return async_rules.submitted_before(self._store.newest_submission(pid), round_)
        return admission.action == "late" and any(s["participant_id"] == pid for s in self._store.submissions(round_))

    @property
    def _async(self) -> bool:
        return self._configs.config.schedule.mode == "async"

    def _weight(self, tokens: int, admission: policy.Admission) -> float:
        cfg = self._configs.config
        weight = float(tokens) if cfg.outer.weighting == "tokens" else 1.0
        if self._async:  # its staleness scales the step instead (`async_rules.scale`): a round is one update
            return weight
        return weight * cfg.staleness_discount**admission.staleness

    # -- the open round's places (`tickets.Seats`) ---------------------------------------------------

    def reserve(self, up: Upload) -> Ticket | None:
        """`up`'s place in the open round, now that its body is verified; None for a duplicate
        (sent again meanwhile); Refused when the round no longer takes it."""
        admission = self.check_open(up.round)  # the round may have closed while the body streamed in
        if self._is_duplicate(up.pid, up.round, admission):
            return None
        open_ = self._rounds.open
        staleness = None
        if self._async:
            if open_.occupied:
                raise Refused(409, "round_closed", f"the global model is still applying other updates after "
                              f"{SEAT_WAIT_S:g}s: download the current global model and continue",
                              {"current_round": open_.version})
            staleness = admission.staleness
        key = open_.key(up.pid, up.round, admission)
        open_.reserve(key, up.tokens, late=admission.action == "late", staleness=staleness)  # the close waits for it
        return Ticket(key, admission, self._weight(up.tokens, admission), open_.version, lambda: self._release(key))

    def _release(self, key: str) -> None:
        """An upload given its place failed after all: the place is free again (updates waiting
        for a seat are told)."""
        self._rounds.open.release(key)
        self._events.notify()

    async def wait_seat(self, up: Upload) -> None:
        """Asynchronous mode: wait (up to SEAT_WAIT_S) until the open round may take `up`: it
        holds no update and is not closing. At once in the other modes, or once the run is over."""
        rounds = self._rounds
        deadline = time.monotonic() + SEAT_WAIT_S
        while self._async and rounds.open.occupied and not rounds.finished:
            if not await self._events.wait_changed(deadline - time.monotonic()):
                return  # (then `reserve` refuses it)

    def refusal(self, up: Upload) -> Refused:
        try:
            self.check_open(up.round)
        except Refused as closed:
            return closed
        return Refused(409, "round_closed", f"round {up.round} closed while the upload streamed in")

    # -- an upload in parts (`parts.py`) -------------------------------------------------------------

    async def receive_part(self, ident: Identity, pid: str, round_: int, claim: PartClaim, digest: str,
                           length: int | None, body: Body, piece: str | None = None) -> dict[str, Any]:
        """Receive one part of `pid`'s update for `round_` (or of its `piece`): checked against
        `digest` and held. The ordinary upload flow (`_receive_update`: the whole digest, header
        and values checked, placed and counted as a whole upload is) reads the body as its parts
        arrive (`PartSessions.consume`); the part that completes the body waits for it to end,
        and answers as that upload does."""
        self._roster.get(ident, pid)
        parts = self._intake.parts
        parts.drop_where(self._still_taken)  # anyone's sessions for rounds gone: reclaimed now
        key = (pid, round_, piece)
        try:
            if piece is not None:
                check_label(piece)
            admitted = self._admit(pid, round_, claim.tokens, claim.digest, claim.total, piece)
            if admitted is not None:
                check_claim(claim, length, admitted[1].limit)
        except Refused:
            await body.drain()
            raise
        if admitted is None:  # the update is in already
            await body.drain()
            return {"accepted": True, "duplicate": True, "round": round_, "part": claim.index, "parts_complete": True,
                    **({"piece": piece} if piece else {})}
        try:
            session = await parts.open(key, claim, admitted[1].limit, lambda: self._stop_parts(key, claim.index),
                                       TAKEOVER_WAIT_S)
        except Refused:
            await body.drain()
            raise

        def read() -> None:  # none yet, or one that stopped short of an answer about the body
            if _restart(session.consumer):
                parts.consume(session, lambda held: self._receive_update(ident, pid, round_, claim.tokens,
                                                                         claim.digest, claim.total, held, piece))

        read()
        fresh = await parts.receive(session, claim.index, digest, body)
        about = {"part": claim.index, "parts": claim.count, "held": len(session.held)}
        if not session.complete or session.assembling or session.gone:
            read()  # (one stopped while this part streamed in starts again now, not at the next part)
            self._events.notify()
            return {"accepted": True, "duplicate": not fresh, "round": round_, "parts_complete": False,
                    **about, **({"piece": piece} if piece else {})}
        session.assembling = True  # (no await since the last part was held: nothing dropped it meanwhile)
        try:
            answer = await self._consumed(session, ident, pid, round_, claim, piece)
        finally:
            parts.drop(session)
        return {**answer, **about, "parts_complete": True}  # (a piece's "complete": its update's)

    async def _consumed(self, session: Session, ident: Identity, pid: str, round_: int, claim: PartClaim,
                        piece: str | None) -> dict[str, Any]:
        """The answer of the flow that read `session`'s body as it came, now that every part is
        held. Where it stopped short of an answer about the body (the round's close or its
        participant's failure stopped it, a newer body took its place in the sum), the whole
        file goes through the flow once more, as it would have without it."""
        consumer = session.consumer
        if consumer is not None:
            try:
                return await asyncio.shield(consumer)
            except asyncio.CancelledError:
                if not consumer.cancelled():
                    raise  # (this request was cancelled: the consumer goes on)
            except Exception as e:
                if not _restart(consumer):
                    raise
                log.info("the upload of %s for round %d in parts is read again whole: %s", pid, round_, e)
        return await self._receive_update(ident, pid, round_, claim.tokens, claim.digest, claim.total,
                                          self._intake.parts.whole(session), piece)

    def part_session(self, ident: Identity, pid: str, round_: int, piece: str | None) -> dict[str, Any]:
        """Which parts of `pid`'s upload in parts for `round_` (or its `piece`) the coordinator
        holds (404 no_upload_session: none in progress; send every part)."""
        self._roster.get(ident, pid)
        if piece is not None:
            check_label(piece)
        session = self._intake.parts.get((pid, round_, piece))
        if session is None:
            raise Refused(404, "no_upload_session", f"no upload in parts of {pid} for round {round_} is in "
                          "progress", {"round": round_})
        return {"round": round_, **({"piece": piece} if piece else {}), **session.view()}

    def _still_taken(self, key: tuple[str, int, str | None]) -> bool:
        """Whether the open round may still take an update for `key`'s round (on time or late)."""
        try:
            self.check_open(key[1])
        except Refused:
            return False
        return True

    def _stop_parts(self, key: tuple[str, int, str | None], mine: int) -> None:
        """Stop the parts of `key`'s upload still streaming (a newer body, whose part `mine`
        is coming in, replaces it)."""
        self._intake.attempts.stop_where(lambda k: isinstance(k, tuple) and len(k) == 4 and k[:3] == key
                                         and k[3] != mine)

    # -- one upload ---------------------------------------------------------------------------------

    async def receive_update(self, ident: Identity, pid: str, round_: int, tokens: int, digest: str,
                             length: int | None, body: Body, piece: str | None = None) -> dict[str, Any]:
        """Verify and fold one participant's pseudo-gradient for `round_`, or one `piece` of it
        (`pieces.py`: counted as submitted once its pieces cover the sync set). Its progress
        shows in the status while it streams in (`Intake.transfer_view`)."""
        progress = Progress(f"upload of round {round_}", length)
        body.count_with(progress.add)
        transfers = self._intake.transfers
        transfers[pid] = progress
        try:
            return await self._receive_update(ident, pid, round_, tokens, digest, length, body, piece)
        finally:
            if transfers.get(pid) is progress:
                del transfers[pid]

    async def _receive_update(self, ident: Identity, pid: str, round_: int, tokens: int, digest: str,
                              length: int | None, body: Body, piece: str | None) -> dict[str, Any]:
        p = self._roster.get(ident, pid)
        try:
            admitted = self._admit(pid, round_, tokens, digest, length, piece)
        except Refused:
            await body.drain()
            raise
        if admitted is None:
            await body.drain()
            return {"accepted": True, "duplicate": True, "round": round_, **({"piece": piece} if piece else {})}
        admission, up, clamped = admitted
        if piece is None:
            return await self._receive(p, up, admission, clamped, body, None)
        try:  # counted as streaming in before a byte is read: bounded per participant (`Intake.hold_piece`)
            self._intake.hold_piece(up, piece, processes.describe(p.info)[1])
        except Refused:
            await body.drain()
            raise
        try:
            return await self._receive(p, up, admission, clamped, body, piece)
        finally:
            self._intake.release_piece(up, piece)

    async def _receive(self, p: ParticipantRow, up: Upload, admission: policy.Admission, clamped: str | None,
                       body: Body, piece: str | None) -> dict[str, Any]:
        """The body of an admitted upload (or piece): read, verified, placed in the round, counted."""
        pid, round_ = up.pid, up.round
        try:
            head, body = await peek_header(body)
            faults.hit("upload.streaming", who=pid, round=round_)
        except BaseException:
            await body.drain()
            raise
        cfg, open_ = self._configs.config, self._rounds.open

        def may_reach() -> int:
            return open_.may_reach(self._roster.active())

        answer: dict[str, Any] = {}
        nbytes, whole_digest = up.length, up.digest
        try:
            if piece is None:
                ticket = await self._intake.receive(up, body, head, admission.action, cfg,
                                                    len(self._roster.active()), self, may_reach)
            else:
                got = await self._intake.receive_piece(up, piece, body, cfg, self, may_reach)
                answer = {"piece": piece, "complete": got.complete, "pieces": got.pieces, "missing": got.missing[:20]}
                if not got.duplicate:  # a piece's bytes count as it comes, its update's tokens once complete
                    self._roster.counted_upload(p, round_, 0, up.length)
                if not got.complete or got.duplicate:
                    self._roster.store_row(p)
                    self._events.notify()
                    return {"accepted": True, "duplicate": got.duplicate, "round": round_, **answer}
                ticket, nbytes, whole_digest = got.ticket, got.length, got.digest
        except Refused as e:
            if e.code in POISON_CODES:
                what = f"the update of {pid}" if piece is None else f"piece {piece!r} of the update of {pid}"
                self._events.record("refuse", f"{what} for round {round_} was refused: {e.message}", pid)
            raise
        if ticket is None:
            return {"accepted": True, "duplicate": True, "round": round_, **answer}
        self._count(p, up, ticket, clamped, nbytes, whole_digest, counted_bytes=piece is None)
        late = ({"folded_into": self._rounds.version, "staleness": ticket.admission.staleness}
                if ticket.admission.action == "late" else {})
        if self._async:
            late = {"applied_in": ticket.open_round, "staleness": ticket.admission.staleness}
        counted = {"tokens_counted": up.tokens, "tokens_reason": clamped} if clamped is not None else {}
        return {"accepted": True, "duplicate": False, "round": round_, **late, **counted, **answer}

    def _admit(self, pid: str, round_: int, tokens: int, digest: str, length: int | None,
               piece: str | None) -> tuple[policy.Admission, Upload, str | None] | None:
        """The checks an upload passes before a byte of its body is read: the round takes it,
        it is not a duplicate (None), its tokens count (bounded: the reason when clamped), its
        length fits. Raises Refused."""
        cfg = self._configs.config
        admission = self.check_open(round_)
        if self._is_duplicate(pid, round_, admission):
            return None
        if cfg.outer.weighting == "tokens" and tokens <= 0:
            raise Refused(400, "invalid_tokens", "tokens must be a positive count of tokens processed this round")
        barred = self._intake.barred(round_, pid)
        if barred is not None:
            raise Refused(422, "update_refused", barred, {"round": round_})
        told = self._store.assignments(round_).get(pid)  # balanced rounds: its own H bounds its claim
        tokens, clamped = policy.count_tokens(tokens, self._configs.for_round(round_, self._rounds.version),
                                              told["sync_every"] if told is not None else None)
        limit = int(cfg.max_upload_mb * 1_000_000)
        if length is None:
            raise Refused(411, "length_required", "uploads need a Content-Length header")
        if length > limit:
            raise Refused(413, "too_large", f"upload of {length:,} bytes exceeds max_upload_mb ({limit:,} bytes)")
        if piece is not None and admission.action != "accept":
            raise Refused(409, "round_closed", f"round {round_} is closed: the pieces of an update are taken for "
                          "the open round only", {"current_round": self._rounds.version})
        if piece is not None and self._async:
            raise Refused(409, "pieces_not_async", "schedule.mode async takes whole updates only: a round closes "
                          "with each update, so the pieces of one would be dropped with it; upload it whole")
        return admission, Upload(pid, round_, tokens, digest, length, limit), clamped

    def _count(self, p: ParticipantRow, up: Upload, ticket: Ticket, clamped: str | None, nbytes: int, digest: str,
               counted_bytes: bool) -> None:
        """An update is in the open round: count it (its participant's counters, unless its
        bytes were counted piece by piece; its submission's row; the round's clock), then
        ask whether the round closes."""
        pid, round_ = up.pid, up.round
        if clamped is not None:
            self._events.record("tokens", f"{pid}'s update for round {round_}: {clamped}", pid)
        self._roster.counted_upload(p, round_, up.tokens, nbytes if counted_bytes else 0)
        if ticket.admission.action == "late":
            self._events.record("late", f"{pid}'s update for round {round_}: {ticket.admission.reason}", pid)
        else:
            self._rounds.open.note_submission(self._rounds.clock())
            try:  # (asynchronous mode: in the round it is applied in; else that is `round_`)
                self._store.add_submission(ticket.open_round, pid, up.tokens, nbytes, digest)
            except Exception as e:
                if storage_full(e):  # folded but not recorded: the round must not commit as it is
                    # the merge fails on it and the run goes back, once there is room (rounds.py)
                    self._intake.fail(f"{pid}'s update for round {round_} could not be recorded: {e}")
                raise
        self._roster.store_row(p)
        self._rounds.maybe_close()
        self._events.notify()
