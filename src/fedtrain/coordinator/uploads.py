"""Receiving an upload: admitting, verifying and folding it (`UploadsMixin`).

How a body's bytes are received, spooled and read back is in `receive.py`.

`UploadsMixin`, a part (mixin) of `Coordinator` (`service.py`): an upload is admitted
into the open round (or folded late), verified while it streams in (header against the
model, the body digest), checked for NaN and Inf, and only then folded into the running
sum, its spool file handed back for reuse (or kept for the round's close, when the
aggregator or the outlier rule needs every update at once).
The finite check is made where it costs least: a plain body's values on the writer
thread as they arrive (`wire.finite.FiniteScan`, numpy over the received chunks); a
compressed body's once decoded, piece by piece as the round's first update is written over
the empty sum (a refusal empties it again, exactly), or in full before a later one is added.
A bad upload therefore never changes the sum: the run's state is left exactly as it was.

Finite is not enough: a value up to 3.4e38 is finite, and an outer step squares (Adam) or
adds up (Nesterov) what it is given. So each update's largest |value| is found with the
NaN/Inf check where that check looks at the values (a direct receive, a first update
written over the sum, a compressed body), and an update beyond `MAX_UPDATE_ABS` is refused
(422 `out_of_range`) before anything of it is in the sum. `FiniteScan` does not report it,
so a later plain spooled update is read once more, before its fold, for it (200 MB:
+10-14 ms on this machine; a scan on arrival that kept the largest value would cost none).
The weight a token claim gives is bounded by the round's schedule (`policy.count_tokens`),
and no update takes more than `outer.max_share` of a round of three or more: an update
that may still be capped waits in its spool file until the close (`policy.to_fold`), since
the sum can only be reweighted as a whole. Every refusal of an update's values is an event
naming its participant.

With at most `DIRECT_MAX_ACTIVE` (4) active participants, the round's first upload skips
the spool file altogether (`_receive_direct`): if the body is plain, of the sum's dtype,
and no rule needs the update before it is weighted, its bytes are read from the socket
straight into the empty sum (with our HTTP protocol, `httpbody.py`, no copy on the way),
hashed and checked finite as they land, then counted with their weight as the sum's scale
(`RunningSum`): no pass over them once the body is in.
Uploads ready meanwhile are answered at once and folded after it (`_fold_later`), so
none waits on another's link; a close of the round or the uploader's failure stops its
writes at once, and whatever goes wrong leaves the sum empty. That saves the first
upload's spool write and read-back, a sizeable part of a round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedtrain import faults
from fedtrain.config import RunConfig, parse_config
from fedtrain.coordinator import policy, storage
from fedtrain.coordinator.auth import Identity
from fedtrain.coordinator.base import CoordinatorBase, Refused, log
from fedtrain.coordinator.receive import Head, peek_header, receive_to_spool
from fedtrain.coordinator.spool import needs_spool
from fedtrain.coordinator.storage import storage_full
from fedtrain.merge import all_finite, check_compatible  # noqa: F401 - all_finite: tests patch it to see no second pass
from fedtrain.merge.aggregate import MAX_UPDATE_ABS, max_abs
from fedtrain.merge.robust import clip_scale, sum_of_squares
from fedtrain.transport import Abandoned, Body
from fedtrain.wire import BodyReader, TensorSpec
from fedtrain.wire.compress import expected_specs, scheme_of

# Codes of refusals of an update's values: each is recorded as an event naming its participant.
POISON_CODES = ("non_finite", "out_of_range", "update_refused")


def _non_finite(name: str) -> Refused:
    return Refused(422, "non_finite", f"tensor {name} contains NaN or Inf; the update was refused")


def _out_of_range(name: str, value: float) -> Refused:
    return Refused(422, "out_of_range",
                   f"tensor {name} holds a value of magnitude {value:.3g}, more than the {MAX_UPDATE_ABS:.3g} a "
                   "pseudo-gradient may hold (an outer step of it could overflow float32); the update was refused",
                   {"tensor": name, "max_abs": value, "limit": MAX_UPDATE_ABS})


def _check_piece(name: str, values: torch.Tensor) -> float:
    """The largest |value| of a piece of an update, or the refusal of the update (422)."""
    m = max_abs(values)
    if not math.isfinite(m):
        raise _non_finite(name)
    if m > MAX_UPDATE_ABS:
        raise _out_of_range(name, m)
    return m


@dataclass(frozen=True)
class _Pending:
    """What folding a verified spool file needs besides its weight (`_check_and_fold`)."""

    key: str
    may_reach: int  # how many updates the round may end with (`policy.to_fold`)
    scale: float = 1.0  # clip_norm's factor on the fold weight
    max_abs: float | None = None  # its largest |value|, when known already


@dataclass
class RoundUpdates:
    """The open round's updates as the merge sees them (`policy.Contribution`): in the sum, or
    waiting in their spool files; and the participants refused for a round (its merge was not
    finite because of their update). Changed under the fold lock; `freed` hands the spool
    files whose updates were folded back to the event loop, which owns the spool files."""

    entries: dict[str, policy.Contribution] = field(default_factory=dict)
    waiting: dict[str, tuple[Path, float]] = field(default_factory=dict)  # key -> (spool file, clip scale)
    pending: dict[Path, _Pending] = field(default_factory=dict)
    barred: dict[tuple[int, str], str] = field(default_factory=dict)  # (round, participant) -> why
    freed: queue.SimpleQueue[Path] = field(default_factory=queue.SimpleQueue)


def _largest(values: np.ndarray | torch.Tensor) -> float:
    """max |value| of a piece (NaN when it holds one): numpy's min and max where it reads the
    dtype (no torch call: on the event loop, torch's intra-op threads cost more than the
    reduction on pieces this small), else torch's."""
    if isinstance(values, torch.Tensor):
        return max_abs(values)
    if values.size == 0:
        return 0.0
    low, high = float(values.min()), float(values.max())
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


class _ValueScan:
    """NaN, Inf and the largest |value| of a direct upload, looked at as its bytes land in the
    sum's tensors (still in the CPU's cache), so that counting it needs no pass over them:
    numpy's min and max cost what the NaN/Inf scan they replace did. `landed(end)`: the body's
    bytes [0, end) are in; an element split between two reads is looked at once its last
    byte is."""

    def __init__(self, layout: Sequence[tuple[TensorSpec, int]], targets: dict[str, torch.Tensor]) -> None:
        self._ranges = [(start, start + spec.nbytes, spec.name, _flat(targets[spec.name]), spec.dtype.itemsize)
                        for spec, start in layout if spec.dtype.is_floating_point and spec.nbytes]
        self._next = 0
        self._done = 0  # elements looked at of the current tensor
        self.max_abs = 0.0
        self.bad: str | None = None  # the first tensor found with a NaN or Inf
        self.too_large: tuple[str, float] | None = None  # the first tensor with a value beyond MAX_UPDATE_ABS

    def landed(self, end: int) -> None:
        while self._next < len(self._ranges) and self.bad is None:
            start, stop, name, flat, size = self._ranges[self._next]
            if end <= start:
                return
            upto = (min(end, stop) - start) // size
            if upto > self._done:
                m = _largest(flat[self._done : upto])
                self._done = upto
                if not math.isfinite(m):
                    self.bad = name
                    return
                if m > MAX_UPDATE_ABS and self.too_large is None:
                    self.too_large = (name, m)
                self.max_abs = max(self.max_abs, m)
            if end < stop:
                return
            self._next, self._done = self._next + 1, 0


class _Direct:
    """An upload being written straight into the running sum (`UploadsMixin._receive_direct`)."""

    def __init__(self, pid: str, body: Body) -> None:
        self.pid = pid
        self.body = body
        self.streaming = True  # the body is still arriving: a close of the round aborts it
        self.aborted = False
        self.interrupted = False  # aborted because its participant failed or left, not by a close
        self.finished = asyncio.Event()

    def release(self, owner: UploadsMixin) -> None:
        if owner._direct is self:
            owner._direct = None
        self.finished.set()


# A direct receive reads the body into the sum this many bytes at a time, and hashes each
# piece while it is still in the CPU's cache.
PIECE = 1 << 20


def _flat(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A flat view of a tensor's memory: numpy's where numpy has its dtype."""
    flat = t.view(-1)
    return flat.numpy() if t.dtype in (torch.float32, torch.float64, torch.float16) and t.device.type == "cpu" else flat


async def _read_into(reader: BodyReader, body: Body, targets: dict[str, torch.Tensor]) -> _ValueScan | None:
    """Read a whole body through `reader`: its header fed, its data read straight into
    `targets` (the tensors the reader allocates), each piece hashed and scanned for NaN, Inf
    and its largest |value| as it lands (still in the CPU's cache). Raises WireError for a
    bad body; returns the scan (None for a body without data)."""
    scan: _ValueScan | None = None
    pos = 0
    while not reader.done:
        need = reader.head_needed
        if need:
            head = await body.read(need)
            reader.feed(head)
            pos += len(head)
            if len(head) < need:
                break
            continue
        if scan is None:  # the header is in: the first data byte comes next
            scan = _ValueScan(reader.layout, targets)
        view = reader.writable()
        assert view is not None
        view = view[:PIECE]
        n = await body.readinto(view)
        reader.wrote(n)
        pos += n
        scan.landed(pos)
        if n < len(view):
            break
    extra = await body.read(1)
    if extra:
        reader.feed(extra)  # raises: trailing bytes
    reader.finish()
    return scan


class UploadsMixin(CoordinatorBase):
    """The coordinator's side of an upload: admit, receive, verify and fold it."""

    _round_updates: RoundUpdates | None = None  # made on first use (`_updates`)

    @property
    def _updates(self) -> RoundUpdates:
        if self._round_updates is None:
            self._round_updates = RoundUpdates()
        return self._round_updates

    def _round_config(self, round_: int) -> RunConfig:
        """The config a participant trained round `round_` with (the one in force then)."""
        found = self.store.config_for_round(round_) if round_ < self.version else None
        return self.config if found is None else parse_config(found[1], source=f"config of round {round_}")

    def _may_reach(self) -> int:
        """How many updates the open round may end with: those in or on their way, plus one per
        active participant yet to send one (`policy.to_fold`)."""
        keys = set(self._updates.entries) | set(self.submitted) | set(self.late)
        waiting = {p.id for p in self.participants.values() if p.state == policy.ACTIVE} - set(self.submitted)
        return len(keys) + len(waiting)

    def _check_open(self, round_: int) -> policy.Admission:
        """Admit an upload for `round_` into the open round (accept or late), or refuse with 409
        (507 while a full disk holds the run back)."""
        if self.storage_full_since is not None:
            raise Refused(507, "insufficient_storage", storage.MESSAGE, {"current_round": self.version})
        admission = policy.admit_upload(round_, self.version, self.closing, self.finished, self.config)
        if admission.action != "refuse":
            return admission
        if admission.code == "run_finished":
            raise Refused(409, "run_finished", admission.reason, {"current_round": self.version, "finished": True})
        raise Refused(
            409,
            "round_closed",
            f"{admission.reason}: download the current global model and continue",
            {"current_round": self.version},
        )

    def _upload_key(self, pid: str, round_: int, admission: policy.Admission) -> str:
        return pid if admission.action == "accept" else f"{pid}@late{round_}"

    def _is_duplicate(self, pid: str, round_: int, admission: policy.Admission) -> bool:
        """Sent before: into the open round, as a late fold, or (late) already part of round_ when it closed."""
        key = self._upload_key(pid, round_, admission)
        if key in self.submitted or key in self.late:
            return True
        return admission.action == "late" and any(s["participant_id"] == pid for s in self.store.submissions(round_))

    async def receive_update(
        self,
        ident: Identity,
        pid: str,
        round_: int,
        tokens: int,
        digest: str,
        length: int | None,
        body: Body | AsyncIterator[bytes],
    ) -> dict[str, Any]:
        """Verify and fold one participant's pseudo-gradient for `round_` (spooled first,
        or for the round's first upload, straight into the sum)."""
        p = self._participant(ident, pid)
        body = Body.of(body)
        try:
            admission = self._check_open(round_)
            if self._is_duplicate(pid, round_, admission):
                await body.drain()
                return {"accepted": True, "duplicate": True, "round": round_}
            if self.config.outer.weighting == "tokens" and tokens <= 0:
                raise Refused(400, "invalid_tokens", "tokens must be a positive count of tokens processed this round")
            barred = self._updates.barred.get((round_, pid))
            if barred is not None:
                raise Refused(422, "update_refused", barred, {"round": round_})
            tokens, clamped = policy.count_tokens(tokens, self._round_config(round_))
            limit = int(self.config.max_upload_mb * 1_000_000)
            if length is None:
                raise Refused(411, "length_required", "uploads need a Content-Length header")
            if length > limit:
                raise Refused(413, "too_large", f"upload of {length:,} bytes exceeds max_upload_mb ({limit:,} bytes)")
        except Refused:
            await body.drain()
            raise
        try:
            head, body = await peek_header(body)
            faults.hit("upload.streaming", who=pid, round=round_)
        except BaseException:
            await body.drain()
            raise
        try:
            if self._can_receive_direct(admission, head):
                done = await self._receive_direct(pid, round_, tokens, digest, length, limit, body)
            else:
                done = await self._receive_spooled(pid, round_, tokens, digest, length, limit, body)
        except Refused as e:
            if e.code in POISON_CODES:
                self._event("refuse", f"the update of {pid} for round {round_} was refused: {e.message}", pid)
            raise
        finally:
            self._give_back_freed()
        if done is None:
            return {"accepted": True, "duplicate": True, "round": round_}
        if clamped is not None:
            self._event("tokens", f"{pid}'s update for round {round_}: {clamped}", pid)
        admission = done
        p.bytes_up += length
        p.tokens += tokens
        p.round = round_
        p.last_seen = self.clock()
        if admission.action == "late":
            self._event("late", f"{pid}'s update for round {round_}: {admission.reason}", pid)
        else:
            self._round_times.append(max(0.0, self.clock() - self.opened_at))
            try:
                self.store.add_submission(round_, pid, tokens, length, digest)
            except Exception as e:
                if storage_full(e):  # folded but not recorded: the round must not commit as it is
                    # the merge fails on it and the run goes back, once there is room (rounds.py)
                    self._fold_failure = f"{pid}'s update for round {round_} could not be recorded: {e}"
                raise
        self.store.upsert_participant(p)
        self._maybe_close()
        self._notify()
        late = {"folded_into": self.version, "staleness": admission.staleness} if admission.action == "late" else {}
        counted = {"tokens_counted": tokens, "tokens_reason": clamped} if clamped is not None else {}
        return {"accepted": True, "duplicate": False, "round": round_, **late, **counted}

    def _give_back_freed(self) -> None:
        """Spool files whose updates were folded (on a worker thread) go back for reuse."""
        freed = self._updates.freed
        while not freed.empty():
            self._spool_files.give_back(freed.get_nowait())

    async def _receive_spooled(self, pid: str, round_: int, tokens: int, digest: str, length: int, limit: int,
                               body: Body) -> policy.Admission | None:
        """Receive an upload into a spool file, check and fold it (or keep it for the round's
        close); returns its admission, None for a duplicate."""
        path, new = self._spool_files.take()
        accepted = deferred = False  # accepted: the round's bookkeeping owns the file (`RoundUpdates`)
        try:
            try:
                _, scan = await receive_to_spool(body, path, digest=digest, length=length, limit=limit,
                                                 on_header=self._check_header)
            except BaseException:
                await body.drain()
                raise
            faults.hit("upload.received", who=pid, round=round_)
            if scan is not None and scan.bad is not None:
                raise _non_finite(scan.bad)
            checked = scan is not None  # a plain body's values were checked for NaN and Inf as they arrived
            outer = self.config.outer
            keep = needs_spool(outer) or self._retains_all()
            # Otherwise, with no rule that needs the update whole first (clip_norm, outlier_factor,
            # a robust aggregator), its values are checked as it is folded (see _check_and_fold).
            # Beside a direct receive they are checked now: the answer comes before the fold.
            at_fold = not keep and outer.clip_norm is None
            largest: float | None = None
            if not at_fold or self._direct is not None:
                largest = await asyncio.to_thread(self.check_values, path, checked=checked)
                checked = True
            norm = await asyncio.to_thread(self._norm, path)
            if not at_fold:  # (never beside a direct receive, which needs at_fold: a safeguard)
                await self._direct_finished()
            admission = self._check_open(round_)  # the round may have closed while the body streamed in
            key = self._upload_key(pid, round_, admission)
            if self._is_duplicate(pid, round_, admission):
                return None
            weight = self._weight(tokens, admission)
            self._folds += 1
            reserved = self.submitted if admission.action == "accept" else self.late
            reserved[key] = tokens  # reserved now, so that the round waits for this fold
            scale = 1.0 if at_fold else clip_scale(norm, outer.clip_norm)
            pending = _Pending(key, self._may_reach(), scale, largest)
            if at_fold and self._direct is not None:
                # The sum is the direct upload's until it is counted: answer now (the values are
                # checked), fold then. The round's close waits for it (`_folds`).
                self._fold_later(path, weight, pending)
                deferred = True
                return admission
            try:
                if keep:
                    assert largest is not None
                    with self._fold_lock:
                        self.round_spool.keep(key, path, self.version, weight, norm)
                        self._updates.entries[key] = policy.Contribution(weight, largest, folded=False)
                else:
                    self._updates.pending[path] = pending
                    await asyncio.to_thread(self._check_and_fold, path, weight, checked)
            except BaseException:
                reserved.pop(key, None)
                raise
            finally:
                self._updates.pending.pop(path, None)
                self._folds -= 1
            accepted = True
        finally:
            if not (accepted or deferred):
                self._spool_files.discard(path, new)
        return admission

    def _retains_all(self) -> bool:
        """Every update waits on disk for the close: a cap below one half (`policy.retain_all`)."""
        outer = self.config.outer
        return outer.aggregator == "mean" and policy.retain_all(outer.max_share)

    def _fold_later(self, path: Path, weight: float, pending: _Pending) -> None:
        """Fold a checked spool file once the direct upload in the sum is counted (or stopped);
        `_folds` was raised for it. If the fold fails, the round cannot be merged without
        it (its participant was told it is in): the merge refuses, and the round goes back."""
        async def fold() -> None:
            placed = False
            try:
                await self._direct_finished()
                self._updates.pending[path] = replace(pending, may_reach=self._may_reach())
                await asyncio.to_thread(self._check_and_fold, path, weight, True)
                placed = True
            except asyncio.CancelledError:  # shutting down: the round is not merged now
                self._fold_failure = "the fold of an accepted upload was cancelled"
                raise
            except Exception as e:  # noqa: BLE001 - any failure: the round must not be merged without it
                log.exception("a deferred fold failed")
                self._fold_failure = f"the fold of an accepted upload failed ({e})"
            finally:
                self._updates.pending.pop(path, None)
                self._folds -= 1
                if not placed:
                    self._spool_files.give_back(path)
                self._give_back_freed()

        task = asyncio.create_task(fold())
        self._deferred_folds.add(task)
        task.add_done_callback(self._deferred_folds.discard)

    def _weight(self, tokens: int, admission: policy.Admission) -> float:
        weight = float(tokens) if self.config.outer.weighting == "tokens" else 1.0
        return weight * self.config.staleness_discount**admission.staleness

    # At most this many active participants for a direct receive. The others' uploads are
    # answered at once but fold only after it is counted, so if it ends last their folds
    # follow it instead of overlapping the network; with three of them at most, that delay is
    # about what the direct receive saves.
    DIRECT_MAX_ACTIVE = 4

    def _can_receive_direct(self, admission: policy.Admission, head: Head | None) -> bool:
        """Whether this upload may be written straight into the running sum: the round's first
        (nothing folded, none folding, none direct) with few participants active, into
        the open round, a plain body of the sum's dtype, and no rule that needs the update
        before it is weighted (clip_norm) or kept whole (a robust aggregator, outlier_factor).
        With late_uploads=fold an upload whose round closes while it streams in is folded
        into the next one, which needs its bytes in a file; so then every upload is spooled."""
        outer, cfg = self.config.outer, self.config
        active = sum(1 for p in self.participants.values() if p.state == policy.ACTIVE)
        if (head is None or admission.action != "accept" or self._direct is not None or self._folds
                or self.acc.count or self._updates.entries or active > self.DIRECT_MAX_ACTIVE
                or needs_spool(outer) or self._retains_all()
                or outer.clip_norm is not None or cfg.late_uploads == "fold"
                or scheme_of(head[1])[0] != "none"):
            return False
        targets = self.acc.empty_targets()
        specs = head[0]
        return set(specs) == set(targets) and all(
            t.device.type == "cpu" and specs[n].dtype == t.dtype and specs[n].shape == tuple(t.shape)
            for n, t in targets.items())

    async def _receive_direct(self, pid: str, round_: int, tokens: int, digest: str, length: int, limit: int,
                              body: Body) -> policy.Admission | None:
        """Receive the round's first upload straight into the (empty) running sum: no spool
        file, no read-back; with our HTTP protocol, not even a copy, the socket is read into
        the sum. Its bytes are verified as they land (header, length, digest, NaN and Inf),
        then counted with their weight; anything wrong leaves the sum empty, exactly. A close
        of the round while the body streams in stops the writes at once (409, as for any
        upload whose round closed); the sum is then empty again, and the round does not
        wait for the rest of the body."""
        direct = _Direct(pid, body)
        self._direct = direct
        targets = self.acc.empty_targets()
        try:
            reader = BodyReader(expected_digest=digest, max_bytes=limit, expected_length=length,
                                on_header=self._check_header, allocate=lambda spec: targets[spec.name])
            try:
                scan = None
                with contextlib.suppress(Abandoned):  # by `_abort_direct`, which marked it aborted
                    scan = await _read_into(reader, body, targets)
                if direct.aborted:
                    raise self._why_stopped(direct, round_)
            except BaseException:
                await body.drain()
                raise
            direct.streaming = False
            faults.hit("upload.received", who=pid, round=round_)
            admission = self._check_open(round_)
            key = self._upload_key(pid, round_, admission)
            if self._is_duplicate(pid, round_, admission):
                return None
            weight = self._weight(tokens, admission)
            self._folds += 1
            self.submitted[key] = tokens  # reserved now, so that the round waits for this fold
            try:
                await asyncio.to_thread(self._take_direct, weight, scan, key)
            except BaseException:
                self.submitted.pop(key, None)
                raise
            finally:
                self._folds -= 1
            return admission
        finally:  # what was written but not taken is no contribution: the sum stays empty
            direct.release(self)

    def _why_stopped(self, direct: _Direct, round_: int) -> Refused:
        if direct.interrupted:  # its participant failed or left meanwhile: sending again is fine
            return Refused(503, "upload_interrupted", f"the upload of {direct.pid} was stopped when the coordinator "
                           "marked it failed or gone; send it again")
        try:
            self._check_open(round_)
        except Refused as closed:
            return closed
        return Refused(409, "round_closed", f"round {round_} closed while the upload streamed in")

    def _take_direct(self, weight: float, scan: _ValueScan | None, key: str) -> None:
        """Count the values written into the sum as its first contribution, or refuse them
        (422): as `scan` found them as they landed, else checked now."""
        if scan is not None and scan.bad is not None:
            raise _non_finite(scan.bad)  # not taken: the sum stays empty
        if scan is not None and scan.too_large is not None:
            raise _out_of_range(*scan.too_large)
        largest = [0.0]

        def check(name: str, values: torch.Tensor) -> None:
            largest[0] = max(largest[0], _check_piece(name, values))

        with self._fold_lock:
            if scan is None:  # `check` refuses any value beyond MAX_UPDATE_ABS: a bound for the sum
                self.acc.take_written(weight, check, max_abs=MAX_UPDATE_ABS)
            else:
                self.acc.take_written(weight, None, max_abs=scan.max_abs)
            m = scan.max_abs if scan is not None else largest[0]
            self._updates.entries[key] = policy.Contribution(weight, m, folded=True)

    async def _direct_finished(self) -> None:
        """Wait until no upload is being written straight into the sum."""
        while self._direct is not None:
            await self._direct.finished.wait()

    def _abort_direct(self, pid: str | None = None) -> None:
        """The round is closing (or `pid`, the uploader, failed or left): an upload still
        streaming into the sum stops writing into it now (it checks before each chunk, on
        this same event loop) and gives the sum up, so neither the merge nor an upload that
        waits to fold waits for the rest of its body. One already received is a fold in
        progress, which the close waits for."""
        direct = self._direct
        if direct is not None and direct.streaming and pid in (None, direct.pid):
            direct.aborted, direct.interrupted = True, pid is not None
            direct.body.abandon()  # no byte lands in the sum after this
            direct.release(self)

    def _check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        scheme, block = scheme_of(metadata)  # compressed deltas carry their scheme in the header
        check_compatible(expected_specs(self.spec, scheme, block), {n: (s.dtype, s.shape) for n, s in specs.items()},
                         what="update")

    def _norm(self, path: Path) -> float:
        """The L2 norm of a verified upload when a rule needs it (clip_norm, outlier_factor), else 0."""
        outer = self.config.outer
        if outer.clip_norm is None and outer.outlier_factor is None:
            return 0.0
        with self._fold_lock:
            return math.sqrt(sum(sum_of_squares(t) for _, _, t in self.spooled(path)))

    def _fold(self, path: Path, weight: float, scale: float = 1.0, locked: bool = False,
              largest: float | None = None) -> None:
        """Fold a verified spool file; `scale` < 1 clips the update's norm (its weight counts in
        full). `largest`: its largest |value|, when known (the sum's bound needs it; the clip
        scale is in the fold weight, not in the values)."""
        with contextlib.nullcontext() if locked else self._fold_lock:
            for name, start, values in self.spooled(path):
                self.acc.fold_part(name, start, values, weight * scale, largest)
            self.acc.finish_contribution(weight)

    def _check_and_fold(self, path: Path, weight: float, checked: bool = False) -> None:
        """Refuse an upload with a NaN or Inf or a value beyond MAX_UPDATE_ABS (422), else fold
        it or let it wait (`_place`); the sum is left as it was on refusal. `checked`: its NaN
        and Inf were looked for as it arrived. The round's first update is checked piece by
        piece as it is written over the (empty) sum, one read of the file instead of two, and
        a refusal undoes it with `reset()`; a later one is read once before it is added, for
        its largest value (and its NaN and Inf, if not `checked`). `RoundUpdates.pending`
        holds its key and what else is known of it."""
        pending = self._updates.pending.get(path) or _Pending(path.name, policy.MIN_FOR_CAP)
        with self._fold_lock:
            largest = pending.max_abs
            if largest is None and not (self.acc.count or self._updates.entries):
                largest = self._fold_first(path, weight * pending.scale, weight)
                self._updates.entries[pending.key] = policy.Contribution(weight, largest, folded=True)
                self._updates.freed.put(path)
                return
            if largest is None:
                largest = self.check_values(path, locked=True, checked=checked)
            self._updates.entries[pending.key] = policy.Contribution(weight, largest, folded=False)
            self._updates.waiting[pending.key] = (path, pending.scale)
            self._fold_ready(pending.may_reach)

    def _fold_first(self, path: Path, fold_weight: float, weight: float) -> float:
        """Write the round's first update over the empty sum, checking each piece as it goes;
        its largest |value|. A refusal leaves the sum empty (`reset()`). Under the fold lock."""
        largest = 0.0
        try:
            for name, start, values in self.spooled(path):
                m = _check_piece(name, values)
                largest = max(largest, m)
                self.acc.fold_part(name, start, values, fold_weight, m)
            self.acc.finish_contribution(weight)
        except BaseException:
            self.acc.reset()  # it was the only contribution: back to none, exactly
            raise
        return largest

    def _fold_ready(self, may_reach: int) -> None:
        """Fold the waiting updates that `policy.to_fold` lets into the sum now (under the fold
        lock). One that fails to fold leaves the sum half-folded: the round cannot be merged."""
        updates = self._updates
        for key in policy.to_fold(updates.entries, self.config.outer.max_share, may_reach):
            path, scale = updates.waiting.pop(key)
            entry = updates.entries[key]
            try:
                self._fold(path, entry.weight, scale, locked=True, largest=entry.max_abs)
            except Exception as e:  # noqa: BLE001 - any failure: the round must not be merged without it
                log.exception("the fold of a waiting update failed")
                self._fold_failure = f"the fold of the accepted update of {key} failed ({e})"
                return
            updates.entries[key] = replace(entry, folded=True)
            updates.freed.put(path)

    def fold_waiting(self, fold_weights: dict[str, float]) -> None:
        """At the close (under the fold lock): fold each waiting update with the weight the round's
        capped shares give it (`policy.closing_weights`)."""
        updates = self._updates
        for key, weight in fold_weights.items():
            path, scale = updates.waiting.pop(key)
            self._fold(path, weight, scale, locked=True, largest=updates.entries[key].max_abs)
            updates.entries[key] = replace(updates.entries[key], folded=True)
            updates.freed.put(path)

    def _clear_updates(self) -> None:
        """The round is over (merged or gone back): its waiting spool files go back for reuse."""
        updates = self._updates
        for path, _ in updates.waiting.values():
            self._spool_files.give_back(path)
        self._give_back_freed()
        updates.entries.clear()
        updates.waiting.clear()

    def spooled(self, path: Path) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, first element, values) of a verified spool file: pieces of the staging
        buffer for a plain body, whole decoded tensors for a compressed one. The caller holds
        the fold lock; each piece is valid until the next."""
        metadata = self._staging.header(path)[1]
        if scheme_of(metadata)[0] == "none":
            return self._staging.pieces(path)
        decoded = self._staging.decoded(path, {n: d for n, (d, _) in self.spec.items()}, metadata)
        return ((name, 0, t) for name, t in decoded)

    def check_values(self, path: Path, locked: bool = False, checked: bool = False) -> float:
        """Refuse a spooled upload with a NaN or Inf anywhere, or a value beyond MAX_UPDATE_ABS
        (one piece in memory at a time, under the fold lock so concurrent uploads do not
        multiply the memory); its largest |value|. One fused min/max pass finds both, so
        `checked` (no NaN or Inf, seen as it arrived) saves nothing here."""
        largest = 0.0
        with contextlib.nullcontext() if locked else self._fold_lock:
            for name, _, values in self.spooled(path):
                largest = max(largest, _check_piece(name, values))
        return largest
