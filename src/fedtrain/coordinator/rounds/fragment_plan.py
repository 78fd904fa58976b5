"""The coordinator's Streaming DiLoCo plan: which tensors each round syncs.

More: docs/architecture.md, "coordinator/rounds/fragment_plan.py".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedtrain.config import RunConfig
from fedtrain.errors import ConfigError, Refused
from fedtrain.streaming import fragments
from fedtrain.wire.compress import base_name

_MAX_LISTED = 10  # names in a message
_MAX_DETAILS = 100  # names in an error's details


@dataclass(frozen=True)
class Fragment:
    """The fragment one round syncs: the round, the fragment's index and K, its tensor names
    (in the model's order)."""

    round: int
    index: int
    k: int
    names: tuple[str, ...]

    def describe(self) -> str:
        return f"round {self.round} syncs fragment {self.index} of {self.k} ({len(self.names)} tensors)"


@dataclass(frozen=True)
class FragmentPlan:
    """The K fragments of the sync set, each a tuple of tensor names in the model's order."""

    names: tuple[tuple[str, ...], ...]

    @property
    def k(self) -> int:
        return len(self.names)

    def of(self, round_: int) -> int:
        """The fragment round `round_` syncs (rounds count from 0)."""
        return round_ % self.k

    def fragment(self, round_: int) -> Fragment:
        p = self.of(round_)
        return Fragment(round_, p, self.k, self.names[p])

    def view(self) -> dict[str, Any]:
        """As the join answer gives it: `{"fragments": [[names of fragment 0], ...], "k": K}`."""
        return {"fragments": [list(f) for f in self.names], "k": self.k}


def plan_for(cfg: RunConfig, names: Sequence[str]) -> FragmentPlan | None:
    """The plan of a run whose sync set is `names` (in the model's order); None without
    streaming. Raises ConfigError saying why the assignment does not fit the model."""
    st = cfg.streaming
    if st is None:
        return None
    how = st.assign if isinstance(st.assign, str) else "name patterns"
    try:
        split = fragments(list(names), st.fragments, st.assign)
    except ConfigError as e:
        raise ConfigError(f"streaming: the model's {len(names)} tensors cannot be split into "
                          f"{st.fragments} fragments ({how}): {e.message}", details=e.details) from None
    return FragmentPlan(tuple(tuple(f) for f in split))


def check_fragment(fragment: Fragment, model: Mapping[str, object], header: Iterable[str], *, whole: bool) -> None:
    """Refuse (400 `wrong_fragment`) a body for `fragment`'s round holding tensors of another
    fragment, or, `whole` (an update sent in one body, not a piece), not all of the fragment's.
    `header`: the body's tensor names (an int8 body's scales are matched to their tensors). A
    body naming a tensor the model does not have is left to the model check (422)."""
    names = [_base(n, model) for n in header]
    if any(n not in model for n in names):
        return
    inside, held = set(fragment.names), set(names)
    extra = list(dict.fromkeys(n for n in names if n not in inside))
    missing = [n for n in fragment.names if n not in held] if whole else []
    if not extra and not missing:
        return
    parts = ([f"missing: {_listed(missing)}"] if missing else []) + (
        [f"not in fragment {fragment.index}: {_listed(extra)}"] if extra else [])
    raise Refused(400, "wrong_fragment", f"{fragment.describe()}, and an update for it holds exactly that "
                  "fragment's tensors (the join answer's `streaming.fragments` lists each fragment's): "
                  + "; ".join(parts),
                  {"round": fragment.round, "fragment": fragment.index, "k": fragment.k,
                   "missing": missing[:_MAX_DETAILS], "unexpected": extra[:_MAX_DETAILS]})


def _base(name: str, model: Mapping[str, object]) -> str:
    """The model tensor a body's tensor stands for: itself, or the one a scale or index part belongs to."""
    if name not in model and base_name(name) in model:
        return base_name(name)
    return name


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")
