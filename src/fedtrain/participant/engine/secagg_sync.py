"""A participant's round with secure aggregation: the protocol's steps over the routes, around the
upload of its masked update (`SyncEngine.fetch` calls `submit_masked` instead of `submit`).

    keys    advertise two fresh X25519 public keys (and, if we have trained, the token count)
    shares  read the directory (keys, neighbours), post sealed Shamir shares to the neighbours
    claims  read the mailbox (shares for us, who shared); claim the token count if not claimed yet
    upload  read the public weights, mask Δ (or, with DP, its clipped and noised weighted
            contribution) in the ring, and upload it through the update route
    reveal  read the unmask request, post the shares it asks for (`SecAggParticipant.reveal`'s rules)

Masks drawn ahead (`start_ahead`, at the round's start, on a thread of its own): keys and shares
are exchanged while the inner steps run, without the token claim (not known before training), and
the masks drawn (`SecAggParticipant.precompute`: they depend on the keys and on who shared, not
on Δ or its weight); after training only the claim, the encoding and one ring addition per tensor
remain (`submit_masked` takes what `start_ahead` left in `engine.masks_ahead`). Without it, or when
it did not get there (the attempt changed, the round moved on), the steps all run at upload time.

A new session (the coordinator restarted, or the round's attempt was refused) starts the steps
again with fresh keys and the same Δ; a round that moved on without us (we came after its keys
phase closed, or it closed) drops our update and we download the current model.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedtrain import faults
from fedtrain.config import RunConfig, TransferConfig
from fedtrain.errors import ConfigError, CoordinatorError, CoordinatorUnavailable, FedtrainError, RoundClosedError
from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.client.retry import RetryPolicy
from fedtrain.participant.client.secagg import SecAggCalls
from fedtrain.privacy.clipping import distributed_std, private_contribution
from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import ParticipantKeys, PublicKeys
from fedtrain.privacy.participant_round import GroupMasks, SecAggParticipant
from fedtrain.privacy.round_setup import SECAGG_META, setup_from_json
from fedtrain.privacy.unmask import RevealedShare
from fedtrain.transport.progress import Progress
from fedtrain.wire import EncodedBody

log = logging.getLogger("fedtrain.participant")

#: Codes that mean the attempt we were in is gone (the round's steps start again).
_GONE = frozenset({"secagg_session", "secagg_phase", "secagg_not_member"})


class SyncEngine(Protocol):
    """What the masking steps need of the participant's sync engine (`engine/sync.py` SyncEngine)."""

    client: CoordinatorClient
    who: str | None
    patience_s: float
    wait_s: float
    cancel: threading.Event
    bytes_up: int
    last_answer: dict[str, Any] | None
    params: Mapping[str, torch.Tensor]
    masks_ahead: Future[Ahead | None] | None
    deltas: bool

    @property
    def piece(self) -> Any: ...

    def delta_view(self) -> dict[str, torch.Tensor]: ...

    def download(self, pid: str, *, after_round: int | None = None, retry: RetryPolicy | None = None,
                 transfer: TransferConfig | None = None) -> int: ...


@dataclass
class Ahead:
    """Round `round`'s attempt `session` joined before training ended: our id, the protocol's
    state with the masks drawn, and who shared (the claim, the encoding and the upload remain)."""

    round: int
    session: str
    me: int
    sp: SecAggParticipant
    sharing: list[int]


class _Restart(Exception):
    """The attempt changed under us: start the round's steps again."""


class _Moved(Exception):
    """The round is no longer open: our update is not in it."""


def submit_masked(engine: SyncEngine, r: int, pid: str, config: RunConfig, *, tokens: int,
                  retry: RetryPolicy | None = None) -> bool:
    """Send our Δ (held in the engine's snapshot) to round r under secure aggregation and wait
    until the round is merged: True, or False when our update is not in it (the caller then
    downloads the current model, as after a round that closed before our upload)."""
    if engine.piece is not None:  # (an FSDP group's masked pieces: `secagg_pieces.exchange_masked_pieces`)
        raise ConfigError("an FSDP rank masks its rows as a piece of its group's update: use exchange_masked_pieces")
    calls = SecAggCalls(engine.client, pid, retry)
    give_up_at = time.monotonic() + _patience(engine, config)
    ahead = _take_ahead(engine, r)
    while True:
        try:
            if ahead is not None:
                prepared, ahead = ahead, None  # (used once: a restart runs every step again)
                return _finish_ahead(engine, calls, prepared, config, tokens, give_up_at)
            return _one_attempt(engine, calls, r, pid, config, tokens, give_up_at)
        except _Restart as e:
            log.warning("round %d: secure aggregation starts again (%s)", r, e)
        except _Moved as e:
            log.warning("round %d moved on without our update (%s); taking the current model", r, e)
            return False
        except PrivacyError as e:  # e.g. a sealed bundle that fails authentication: a peer or relay lied
            log.warning("round %d: our update is left out of the secure aggregation (%s)", r, e.args[0])
            return False


def exchange_masked(engine: SyncEngine, r: int, pid: str, config: RunConfig, *, tokens: int,
                    retry: RetryPolicy | None = None) -> int:
    """`submit_masked` then the download: the whole masked exchange of round r, run on the
    overlapped sync's worker thread (`sync_schedule.Exchanges.send`) while training goes on, as
    the plain `SyncEngine.exchange` is. Leaves the new global weights in the snapshot; their version."""
    engine.deltas = config.train.download_compression != "none"  # (as `SyncEngine.exchange` sets it)
    submit_masked(engine, r, pid, config, tokens=tokens, retry=retry)
    return engine.download(pid, after_round=r, retry=retry, transfer=config.transfer)


def start_ahead(engine: SyncEngine, r: int, pid: str, config: RunConfig, retry: RetryPolicy | None = None) -> None:
    """At round r's start: join its attempt and draw the masks on a thread of our own while the
    inner steps run (`engine.masks_ahead`, which `submit_masked` takes). A failure only means the
    steps run at upload time."""
    future: Future[Ahead | None] = Future()
    engine.masks_ahead = future

    def run() -> None:
        try:
            future.set_result(_prepare(engine, SecAggCalls(engine.client, pid, retry), r, config))
        except (_Moved, _Restart, FedtrainError, PrivacyError, KeyError, ValueError) as e:
            log.info("round %d: masks not drawn ahead (%s): they are drawn at upload time", r, e)
        finally:  # (never leaves the upload waiting: None, and the upload runs every step itself)
            if not future.done():
                future.set_result(None)

    threading.Thread(target=run, name=f"fedtrain-secagg-{r}", daemon=True).start()


@dataclass
class Lead:
    """Rank 0 of an FSDP group in round `round`'s attempt, up to the upload: its protocol state,
    and what every rank needs to mask its rows (the seeds, the public weight, the tokens counted;
    with DP each rank's share of the noise, `std`)."""

    round: int
    sp: SecAggParticipant
    counted: int
    state: dict[str, Any]
    masks: GroupMasks
    weight: float
    std: float

    def payload(self) -> dict[str, Any]:
        """What rank 0 tells its ranks over the group's control channel (never beyond it)."""
        return {"round": self.round, "session": self.state["session"], "counted": self.counted,
                "weight": self.weight, "std": self.std, "masks": self.masks.to_json()}


def lead_join(engine: SyncEngine, r: int, pid: str, config: RunConfig, *, tokens: int,
              retry: RetryPolicy | None = None) -> Lead | None:
    """Rank 0 of an FSDP group: round r's steps up to the public weights (keys with the claim,
    shares, mailbox), again on a new session; None when our update is not in the round (it moved
    on, or a peer's shares failed): the group then downloads the current model."""
    calls = SecAggCalls(engine.client, pid, retry)
    give_up_at = time.monotonic() + _patience(engine, config)
    p = config.privacy
    assert p is not None  # (secure aggregation is on)
    while True:
        try:
            sp, me, sharing, counted, state = _join(engine, calls, r, tokens, give_up_at)
            state = _weights(engine, calls, r, me, state, give_up_at)
            weights = {k: float(w) for k, w in state["weights"].items()}
            std = distributed_std(p.noise_multiplier, p.clip_norm, max(weights.values()),
                                  sp.setup.threshold) if p.dp else 0.0
            return Lead(r, sp, counted, state, sp.group_masks(sharing), weights[str(me)], std)
        except _Restart as e:
            log.warning("round %d: secure aggregation starts again (%s)", r, e)
        except _Moved as e:
            log.warning("round %d moved on without our update (%s); taking the current model", r, e)
            return None
        except PrivacyError as e:
            log.warning("round %d: our update is left out of the secure aggregation (%s)", r, e.args[0])
            return None


def lead_finish(engine: SyncEngine, lead: Lead, pid: str, config: RunConfig, body: EncodedBody | None,
                retry: RetryPolicy | None = None) -> bool:
    """Rank 0 once its ranks have masked their rows: its own piece up (`body`, if it sends rows),
    the reveal, the wait for the merge. False: our update is not in the round. An attempt that
    starts again after the pieces went up fails the group's sync (tried again whole, later)."""
    calls = SecAggCalls(engine.client, pid, retry)
    give_up_at = time.monotonic() + _patience(engine, config)
    r = lead.round
    try:
        if body is not None:
            if faults.hit("participant.upload", who=engine.who or pid, round=r) == "drop":
                raise _Moved("the masked piece was dropped")
            _send(engine, calls, r, body, lead.counted, config, piece=engine.piece.label)
        return _reveal(engine, calls, lead.sp, r, lead.state, give_up_at)
    except _Moved as e:
        log.warning("round %d moved on without our update (%s); taking the current model", r, e)
        return False
    except _Restart as e:
        raise CoordinatorUnavailable(f"round {r}'s secure aggregation started again after our pieces went up "
                                     f"({e}): the group's sync is tried again", status=0, code="unavailable") from None


def _patience(engine: SyncEngine, config: RunConfig) -> float:
    phase_s = config.privacy.secagg_phase_timeout_s if config.privacy is not None else 0.0
    return config.round_timeout_s + engine.patience_s + 3 * phase_s


def _take_ahead(engine: SyncEngine, r: int) -> Ahead | None:
    future, engine.masks_ahead = engine.masks_ahead, None
    if future is None:
        return None
    ahead = future.result()  # (it ends by itself: each of its waits is bounded)
    return ahead if ahead is not None and ahead.round == r else None


def _prepare(engine: SyncEngine, calls: SecAggCalls, r: int, config: RunConfig) -> Ahead | None:
    """Keys without the claim, shares, mailbox, masks drawn: round r's attempt up to the claim."""
    give_up_at = time.monotonic() + _patience(engine, config)
    state = _open_state(engine, calls, r, give_up_at)
    me = state.get("id")
    if me is None or state["phase"] != "keys":
        return None  # too late for this attempt: the upload's steps take the next one
    session = state["session"]
    keys = ParticipantKeys.generate(int(me))
    _ask(lambda: calls.advertise(r, session, keys.public().to_json(), None))
    state = _wait(engine, calls, r, state, give_up_at)
    sp = SecAggParticipant(int(me), setup_from_json(state["setup"]), keys=keys)
    directory = _ask(lambda: calls.directory(r, session))
    sealed = sp.share({int(i): PublicKeys.from_json(k) for i, k in directory["keys"].items()})
    _ask(lambda: calls.post_shares(r, session, sealed))
    state = _wait(engine, calls, r, state, give_up_at)
    if state["phase"] != "claims":
        return None
    mailbox = _ask(lambda: calls.mailbox(r, session))
    sp.receive({int(s): bytes.fromhex(b) for s, b in mailbox["mail"].items()})
    sharing = [int(i) for i in mailbox["sharing"]]
    sp.precompute({n: t.numel() for n, t in engine.params.items()}, sharing)
    return Ahead(r, session, int(me), sp, sharing)


def _open_state(engine: SyncEngine, calls: SecAggCalls, r: int, give_up_at: float) -> dict[str, Any]:
    """Round r's attempt, once round r is the open round (overlapped: the one before may still be
    merging when we start r)."""
    while True:
        try:
            return calls.state(r)
        except CoordinatorError as e:
            behind = e.code == "round_not_open" and int(e.details.get("current_round", r)) < r
            if not behind or time.monotonic() > give_up_at or engine.cancel.is_set():
                raise _Moved(e.message) from None
        time.sleep(0.1)


def _finish_ahead(engine: SyncEngine, calls: SecAggCalls, ahead: Ahead, config: RunConfig, tokens: int,
                  give_up_at: float) -> bool:
    """The steps after training, with keys and shares exchanged and the masks drawn: claim, mask
    (one ring addition per tensor), upload, reveal."""
    r, session = ahead.round, ahead.session
    state = _ask(lambda: calls.state(r))
    if state["session"] != session or state["phase"] not in ("shares", "claims"):
        raise _Restart(f"the attempt we drew masks for is in its {state['phase']} phase, session {state['session']}")
    counted = _ask(lambda: calls.claim(r, session, tokens))["tokens_counted"]
    log.info("round %d: keys, shares and masks were drawn during the inner steps; claimed %d tokens", r, counted)
    return _upload_and_reveal(engine, calls, ahead.sp, ahead.me, ahead.sharing, r, config, int(counted), state,
                              give_up_at)


def _one_attempt(engine: SyncEngine, calls: SecAggCalls, r: int, pid: str, config: RunConfig, tokens: int,
                 give_up_at: float) -> bool:
    sp, me, sharing, counted, state = _join(engine, calls, r, tokens, give_up_at)
    return _upload_and_reveal(engine, calls, sp, me, sharing, r, config, counted, state, give_up_at)


def _join(engine: SyncEngine, calls: SecAggCalls, r: int, tokens: int,
          give_up_at: float) -> tuple[SecAggParticipant, int, list[int], int, dict[str, Any]]:
    """Keys (with the claim), shares, mailbox: (our state, id, who shared, tokens counted, the state)."""
    state = _ask(lambda: calls.state(r))
    session = state["session"]
    me = state.get("id")
    if me is None or state["phase"] != "keys":  # too late for this attempt: wait for the next one or the end
        _wait(engine, calls, r, state, give_up_at)
        raise _Restart(f"joined after the keys phase of session {session}")
    keys = ParticipantKeys.generate(int(me))
    counted = _ask(lambda: calls.advertise(r, session, keys.public().to_json(), tokens))["tokens_counted"]
    state = _wait(engine, calls, r, state, give_up_at)
    setup = setup_from_json(state["setup"])
    sp = SecAggParticipant(int(me), setup, keys=keys)
    directory = _ask(lambda: calls.directory(r, session))
    public = {int(i): PublicKeys.from_json(k) for i, k in directory["keys"].items()}
    sealed = sp.share(public)
    _ask(lambda: calls.post_shares(r, session, sealed))
    state = _wait(engine, calls, r, state, give_up_at)
    mailbox = _ask(lambda: calls.mailbox(r, session))
    sp.receive({int(s): bytes.fromhex(b) for s, b in mailbox["mail"].items()})
    return sp, int(me), [int(i) for i in mailbox["sharing"]], int(counted), state


def _weights(engine: SyncEngine, calls: SecAggCalls, r: int, me: int, state: dict[str, Any],
             give_up_at: float) -> dict[str, Any]:
    """Wait for the public weights (the claims phase's close): the upload phase's state."""
    while state["phase"] in ("shares", "claims"):
        state = _wait(engine, calls, r, state, give_up_at)
    if state["phase"] != "upload" or str(me) not in (state.get("weights") or {}):
        raise _Moved(f"the claims phase closed without our claim ({state['phase']} phase)")
    return state


def _upload_and_reveal(engine: SyncEngine, calls: SecAggCalls, sp: SecAggParticipant, me: int, sharing: list[int],
                       r: int, config: RunConfig, counted: int, state: dict[str, Any], give_up_at: float) -> bool:
    """Wait for the public weights (the claims phase's close), mask, upload, reveal, wait for the merge."""
    pid = calls.pid
    state = _weights(engine, calls, r, me, state, give_up_at)
    body = _masked_body(engine, sp, config, state["weights"], me, sharing, state["session"])
    if faults.hit("participant.upload", who=engine.who or pid, round=r) == "drop":
        log.warning("fault injected: round %d's masked upload is never sent (a dropout after masking)", r)
        raise _Moved("the masked upload was dropped")
    _send(engine, calls, r, body, counted, config)
    return _reveal(engine, calls, sp, r, state, give_up_at)


def _send(engine: SyncEngine, calls: SecAggCalls, r: int, body: EncodedBody, counted: int, config: RunConfig,
          piece: str | None = None) -> None:
    """Upload a masked body (or an FSDP rank's masked piece) through the update route."""
    which = {"piece": piece} if piece is not None else {}
    what = f"masked upload of round {r}" if piece is None else f"masked piece {piece} of round {r}"
    try:
        engine.last_answer = engine.client.upload(r, calls.pid, body, tokens=counted, retry=calls.retry,
                                                  transfer=config.transfer,
                                                  progress=Progress(what, body.content_length, log=log), **which)
    except RoundClosedError as e:
        raise _Moved(e.message) from None
    except CoordinatorError as e:
        if e.code in _GONE:
            raise _Restart(e.message) from None
        raise
    engine.bytes_up += body.content_length


def _reveal(engine: SyncEngine, calls: SecAggCalls, sp: SecAggParticipant, r: int, state: dict[str, Any],
            give_up_at: float) -> bool:
    """After our upload: reveal the shares the unmask request asks for, wait for the merge."""
    session = state["session"]
    state = _wait(engine, calls, r, state, give_up_at)  # the upload phase ends with the round's close
    try:
        if state["phase"] == "reveal":
            request = _ask(lambda: calls.unmask_request(r, session))
            shares = sp.reveal(request["survivors"], request["dropped"])
            _ask(lambda: calls.reveal(r, session, [_share_json(s) for s in shares]))
            state = _wait(engine, calls, r, state, give_up_at)
        while state["phase"] == "done":
            state = _wait(engine, calls, r, state, give_up_at)
    except _Moved:  # round r is no longer open: merged (a refused round opens again, as another session)
        return True
    raise _Restart(f"the attempt ended in its {state['phase']} phase without a merge")


def _masked_body(engine: SyncEngine, sp: SecAggParticipant, config: RunConfig, weights: dict[str, float], me: int,
                 sharing: list[int], session: str) -> EncodedBody:
    """Δ weighted by our public weight, in the ring, masked; with DP, clipped to C and noised with our
    share of σ·w_max·C first (`private_contribution`: the coordinator never sees an un-noised sum)."""
    delta = engine.delta_view()
    weight = float(weights[str(me)])
    p = config.privacy
    assert p is not None  # (secure aggregation is on)
    if p.dp:
        std = distributed_std(p.noise_multiplier, p.clip_norm, max(weights.values()), sp.setup.threshold)
        gen = torch.Generator().manual_seed(secrets.randbits(63))  # from the OS CSPRNG, never the run's seed
        masked = sp.mask(private_contribution(delta, weight, p.clip_norm, std, gen), 1.0, sharing)
    else:
        masked = sp.mask(delta, weight, sharing)
    tensors = {n: torch.from_numpy(a) for n, a in masked.items()}
    meta = {SECAGG_META: json.dumps({"session": session, "bits": sp.setup.fixed_point.bits})}
    return EncodedBody(tensors, meta, digest_algorithm=config.digest)


def _share_json(s: RevealedShare) -> dict[str, Any]:
    return {"owner": s.owner, "kind": s.kind, "share": s.share.to_bytes().hex()}


def _ask(call: Any) -> dict[str, Any]:
    """One request of the attempt; a refusal that says the attempt is gone restarts the steps."""
    try:
        answer: dict[str, Any] = call()
        return answer
    except RoundClosedError as e:
        raise _Moved(e.message) from None
    except CoordinatorError as e:
        if e.code == "round_not_open":
            raise _Moved(e.message) from None
        if e.code in _GONE:
            raise _Restart(e.message) from None
        raise


def _wait(engine: SyncEngine, calls: SecAggCalls, r: int, state: dict[str, Any], give_up_at: float) -> dict[str, Any]:
    """Long-poll until the attempt leaves the phase of `state`: the new state, or _Restart (another
    session), _Moved (the round closed)."""
    session, phase = state["session"], state["phase"]
    while True:
        now = _ask(lambda: calls.state(r, wait_s=engine.wait_s, phase=phase, session=session))
        if now["session"] != session:
            raise _Restart(f"session {session} was replaced by {now['session']}")
        if now["phase"] != phase:
            return now
        if engine.cancel.is_set():
            raise CoordinatorUnavailable(f"stopped waiting for round {r}: the sync was cancelled", status=0,
                                         code="cancelled")
        if time.monotonic() > give_up_at:
            raise CoordinatorUnavailable(f"round {r}'s secure aggregation is still in its {phase} phase: "
                                         f"{now.get('reason', 'no reason given')}", status=0, code="unavailable")
