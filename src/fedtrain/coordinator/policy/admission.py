"""Pure decisions about one upload: whether it is taken into the open round (`admit_upload`),
where its body goes as it streams in (`receive_path`) and how a verified one is placed
(`place_update`), each with its reason. See docs/architecture.md (policy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedtrain.config import RunConfig
from fedtrain.coordinator.policy.shares import retain_all


@dataclass(frozen=True)
class Admission:
    action: Literal["accept", "late", "refuse"]
    reason: str
    staleness: int = 0
    code: str = ""


def admit_upload(round_: int, version: int, closing: bool, finished: bool, cfg: RunConfig) -> Admission:
    """Whether an upload for `round_` is taken into the open round `version`, and how.

    accept: it is for the open round. late: it is for a round that closed at most
    `max_staleness` rounds ago and `late_uploads` is "fold" (it joins the open round with
    a discounted weight). refuse: everything else, with the 409 code to answer.
    """
    if finished:
        return Admission("refuse", f"the run finished after {version} rounds", code="run_finished")
    if round_ == version and not closing:
        return Admission("accept", f"round {round_} is open")
    if round_ > version:
        return Admission("refuse", f"round {round_} is not open; the current round is {version}", code="round_closed")
    if round_ == version:
        return Admission("refuse", f"round {round_} is closing; the current round is {version}", code="round_closed")
    staleness = version - round_
    if cfg.late_uploads == "fold" and staleness <= cfg.max_staleness and not closing:
        return Admission(
            "late",
            f"round {round_} closed {staleness} round(s) ago; folded into round {version} with weight x "
            f"{cfg.staleness_discount**staleness:g}",
            staleness,
        )
    why = "" if cfg.late_uploads == "refuse" else f" (more than max_staleness {cfg.max_staleness} behind)"
    return Admission(
        "refuse", f"round {round_} is closed{why}; the current round is {version}", staleness, code="round_closed"
    )



# -- how an upload is received and placed, when a change is in force, what state a round is in --

# At most this many active participants for a direct receive. The others' uploads are
# answered at once but fold only after it is counted, so if it ends last their folds
# follow it instead of overlapping the network; with three of them at most, that delay is
# about what the direct receive saves.
DIRECT_MAX_ACTIVE = 4


def keeps_every_update(cfg: RunConfig) -> tuple[bool, str]:
    """Whether the round keeps every update in its spool file until the close, and why: an
    aggregator that needs them all at once, the outlier rule, or a cap below one half."""
    outer = cfg.outer
    if outer.aggregator != "mean":
        return True, f"the {outer.aggregator} aggregator needs every update at once"
    if outer.outlier_factor is not None:
        return True, "outlier_factor compares every update's norm at the close"
    if retain_all(outer.max_share):
        return True, f"max_share {outer.max_share:g} (below one half) is applied exactly only at the close"
    return False, "updates are folded as they come"


@dataclass(frozen=True)
class ReceivePath:
    path: Literal["direct", "spool"]
    reason: str


def receive_path(*, fast_io: bool, action: str, sum_empty: bool, active: int, plain: bool, fits: bool,
                 cfg: RunConfig) -> ReceivePath:
    """Where an upload's body goes as it streams in: straight into the (empty) running sum
    (`direct`: no spool file, no read-back) or into a spool file (`spool`), and why.

    `action`: its admission (`admit_upload`); `sum_empty`: nothing folded, folding or being
    received into the sum; `active`: the active participants; `plain`: an uncompressed body;
    `fits`: its tensors are the sum's (names, dtypes, shapes)."""
    outer = cfg.outer
    if not fast_io:
        return ReceivePath("spool", "the fast IO paths are off (FEDTRAIN_FAST_IO)")
    if cfg.schedule.mode == "async":
        return ReceivePath("spool", "asynchronous mode: an update waits in its spool file for the version it is "
                                    "applied to")
    if action != "accept":
        return ReceivePath("spool", "a late update is folded from its spool file")
    if not sum_empty:
        return ReceivePath("spool", "the sum already holds or receives an update")
    if active > DIRECT_MAX_ACTIVE:
        return ReceivePath("spool", f"{active} participants are active, more than {DIRECT_MAX_ACTIVE}: the others' "
                                    "folds would wait on this one's link")
    keep, why = keeps_every_update(cfg)
    if keep:
        return ReceivePath("spool", why)
    if outer.clip_norm is not None:
        return ReceivePath("spool", "clip_norm needs the update's norm before it is weighted")
    if cfg.late_uploads == "fold":
        return ReceivePath("spool", "with late_uploads=fold an update whose round closes while it streams in is "
                                    "folded into the next one, from its file")
    if not plain:
        return ReceivePath("spool", "a compressed update is decoded from its spool file")
    if not fits:
        return ReceivePath("spool", "the update's tensors are not laid out as the sum's")
    return ReceivePath("direct", "the round's first update, plain and of the sum's layout: received into the sum")


@dataclass(frozen=True)
class Placement:
    """What happens to a verified spooled update: `keep` it in its file until the close, `fold`
    it now (its values checked as it is folded), or check it now and `fold_after` the upload
    being received into the sum is counted; `check_first`: its values are checked before
    it is placed (not as it is folded)."""

    action: Literal["keep", "fold", "fold_after"]
    check_first: bool
    reason: str


def place_update(cfg: RunConfig, direct_in_progress: bool) -> Placement:
    """How a verified spooled update is placed in the open round, and why."""
    keep, why = keeps_every_update(cfg)
    if keep:
        return Placement("keep", True, why)
    if cfg.outer.clip_norm is not None:
        return Placement("fold", True, "clip_norm scales the update by its norm before the fold")
    if direct_in_progress:
        return Placement("fold_after", True, "the sum is the update being received into it until that one is "
                                             "counted: answered now, folded then")
    return Placement("fold", False, "checked as it is folded (one read of its file)")
