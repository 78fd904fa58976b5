"""Receiving an upload: admitting, verifying and folding it (`UploadsMixin`).

How a body's bytes are received, spooled and read back is in `receive.py`.

`UploadsMixin`, a part (mixin) of `Coordinator` (`service.py`): an upload is admitted
into the open round (or folded late), verified while it streams in (header against the
model, the body digest), checked for NaN and Inf, and only then folded into the running
sum, its spool file handed back for reuse (or kept for the round's close, when the
aggregator or the outlier rule needs every update at once).
The finite check is made where it costs least: a plain body's values on the writer
thread as they arrive (`wire.finite.FiniteScan`, numpy over the received chunks), so the
fold reads the file once; a compressed body's once decoded, piece by piece as the round's
first update is written over the empty sum (a refusal empties it again, exactly), or in
full before a later one is added.
A bad upload therefore never changes the sum: the run's state is left exactly as it was.

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
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import torch

from fedtrain import faults
from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import Identity
from fedtrain.coordinator.base import CoordinatorBase, Refused, log
from fedtrain.coordinator.httpbody import Abandoned
from fedtrain.coordinator.receive import Body, Head, peek_header, receive_to_spool, scan_for
from fedtrain.coordinator.spool import needs_spool
from fedtrain.merge import all_finite, check_compatible
from fedtrain.merge.robust import clip_scale, sum_of_squares
from fedtrain.wire import BodyReader, TensorSpec
from fedtrain.wire.compress import expected_specs, scheme_of
from fedtrain.wire.finite import FiniteScan


def _non_finite(name: str) -> Refused:
    return Refused(422, "non_finite", f"tensor {name} contains NaN or Inf; the update was refused")


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


async def _read_into(reader: BodyReader, body: Body) -> FiniteScan | None:
    """Read a whole body through `reader`: its header fed, its data read straight into the
    tensors the reader allocates, each piece hashed and scanned for NaN and Inf as it lands
    (still in the CPU's cache). Raises WireError for a bad body; returns the scan, None
    when it could not look at every value (a dtype it cannot read)."""
    scan: FiniteScan | None = None
    head_bytes, data = 0, False
    while not reader.done:
        need = reader.head_needed
        if need:
            head = await body.read(need)
            reader.feed(head)
            head_bytes += len(head)
            if len(head) < need:
                break
            continue
        if not data:  # the header is in: the first data byte comes next
            data, scan = True, scan_for(reader)
            if scan is not None:
                scan.skip(head_bytes)
        view = reader.writable()
        assert view is not None
        view = view[:PIECE]
        n = await body.readinto(view)
        reader.wrote(n)
        if scan is not None:
            scan.feed(view[:n])
        if n < len(view):
            break
    extra = await body.read(1)
    if extra:
        reader.feed(extra)  # raises: trailing bytes
    reader.finish()
    return scan if scan is not None and scan.complete else None


class UploadsMixin(CoordinatorBase):
    """The coordinator's side of an upload: admit, receive, verify and fold it."""

    def _check_open(self, round_: int) -> policy.Admission:
        """Admit an upload for `round_` into the open round (accept or late), or refuse with 409."""
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
        if self._can_receive_direct(admission, head):
            done = await self._receive_direct(pid, round_, tokens, digest, length, limit, body)
        else:
            done = await self._receive_spooled(pid, round_, tokens, digest, length, limit, body)
        if done is None:
            return {"accepted": True, "duplicate": True, "round": round_}
        admission = done
        p.bytes_up += length
        p.tokens += tokens
        p.round = round_
        p.last_seen = self.clock()
        if admission.action == "late":
            self._event("late", f"{pid}'s update for round {round_}: {admission.reason}", pid)
        else:
            self._round_times.append(max(0.0, self.clock() - self.opened_at))
            self.store.add_submission(round_, pid, tokens, length, digest)
        self.store.upsert_participant(p)
        self._maybe_close()
        self._notify()
        late = {"folded_into": self.version, "staleness": admission.staleness} if admission.action == "late" else {}
        return {"accepted": True, "duplicate": False, "round": round_, **late}

    async def _receive_spooled(self, pid: str, round_: int, tokens: int, digest: str, length: int, limit: int,
                               body: Body) -> policy.Admission | None:
        """Receive an upload into a spool file, check and fold it (or keep it for the round's
        close); returns its admission, None for a duplicate."""
        path, new = self._spool_files.take()
        accepted = deferred = False
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
            checked = scan is not None  # a plain body's values were checked as they arrived
            outer = self.config.outer
            # Otherwise, with no rule that needs the update whole first (clip_norm, outlier_factor,
            # a robust aggregator), its values are checked as it is folded (see _check_and_fold).
            at_fold = not needs_spool(outer) and outer.clip_norm is None
            if not checked and (not at_fold or self._direct is not None):
                await asyncio.to_thread(self.check_values, path)
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
            if at_fold and self._direct is not None:
                # The sum is the direct upload's until it is counted: answer now (the values are
                # checked), fold then. The round's close waits for it (`_folds`).
                self._fold_later(path, weight)
                deferred = True
                return admission
            try:
                if needs_spool(outer):
                    self.round_spool.keep(key, path, self.version, weight, norm)
                elif at_fold:
                    await asyncio.to_thread(self._check_and_fold, path, weight, checked)
                else:
                    await asyncio.to_thread(self._fold, path, weight, clip_scale(norm, outer.clip_norm))
            except BaseException:
                reserved.pop(key, None)
                raise
            finally:
                self._folds -= 1
            accepted = True
        finally:
            if accepted:
                self._spool_files.give_back(path)
            elif not deferred:
                self._spool_files.discard(path, new)
        return admission

    def _fold_later(self, path: Path, weight: float) -> None:
        """Fold a checked spool file once the direct upload in the sum is counted (or stopped);
        `_folds` was raised for it. If the fold fails, the round cannot be merged without
        it (its participant was told it is in): the merge refuses, and the round goes back."""
        async def fold() -> None:
            try:
                await self._direct_finished()
                await asyncio.to_thread(self._check_and_fold, path, weight, True)
            except asyncio.CancelledError:  # shutting down: the round is not merged now
                self._fold_failure = "the fold of an accepted upload was cancelled"
                raise
            except Exception as e:  # noqa: BLE001 - any failure: the round must not be merged without it
                log.exception("a deferred fold failed")
                self._fold_failure = f"the fold of an accepted upload failed ({e})"
            finally:
                self._folds -= 1
                self._spool_files.give_back(path)

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
                or self.acc.count or active > self.DIRECT_MAX_ACTIVE or needs_spool(outer)
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
                    scan = await _read_into(reader, body)
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
                await asyncio.to_thread(self._take_direct, weight, scan)
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

    def _take_direct(self, weight: float, scan: FiniteScan | None) -> None:
        """Count the values written into the sum as its first contribution, or refuse them
        (422): as `scan` found them as they landed, else checked now."""
        if scan is not None and scan.bad is not None:
            raise _non_finite(scan.bad)  # not taken: the sum stays empty
        with self._fold_lock:
            def check(name: str, values: torch.Tensor) -> None:
                if not all_finite(values):
                    raise _non_finite(name)
            self.acc.take_written(weight, check if scan is None else None)

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

    def _fold(self, path: Path, weight: float, scale: float = 1.0, locked: bool = False) -> None:
        """Fold a verified spool file; `scale` < 1 clips the update's norm (its weight counts in full)."""
        with contextlib.nullcontext() if locked else self._fold_lock:
            for name, start, values in self.spooled(path):
                self.acc.fold_part(name, start, values, weight * scale)
            self.acc.finish_contribution(weight)

    def _check_and_fold(self, path: Path, weight: float, checked: bool = False) -> None:
        """Refuse an upload with a NaN or Inf (422), else fold it; the sum is left as it was
        on refusal. Values `checked` already (as they arrived) are folded at once. Else the
        round's first update is checked piece by piece as it is written over the (empty)
        sum, one read of the file instead of two, and a refusal undoes it with `reset()`;
        a later one is checked in full before it is added."""
        with self._fold_lock:
            if self.acc.count or checked:
                if not checked:
                    self.check_values(path, locked=True)
                self._fold(path, weight, locked=True)
                return
            try:
                for name, start, values in self.spooled(path):
                    if not all_finite(values):
                        raise _non_finite(name)
                    self.acc.fold_part(name, start, values, weight)
                self.acc.finish_contribution(weight)
            except BaseException:
                self.acc.reset()  # it was the only contribution: back to none, exactly
                raise

    def spooled(self, path: Path) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, first element, values) of a verified spool file: pieces of the staging
        buffer for a plain body, whole decoded tensors for a compressed one. The caller holds
        the fold lock; each piece is valid until the next."""
        metadata = self._staging.header(path)[1]
        if scheme_of(metadata)[0] == "none":
            return self._staging.pieces(path)
        decoded = self._staging.decoded(path, {n: d for n, (d, _) in self.spec.items()}, metadata)
        return ((name, 0, t) for name, t in decoded)

    def check_values(self, path: Path, locked: bool = False) -> None:
        """Refuse a spooled upload with a NaN or Inf anywhere (one piece in memory at a time,
        under the fold lock so concurrent uploads do not multiply the memory)."""
        with contextlib.nullcontext() if locked else self._fold_lock:
            for name, _, values in self.spooled(path):
                if not all_finite(values):
                    raise _non_finite(name)
