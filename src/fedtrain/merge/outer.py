"""The outer step: a real `torch.optim` optimizer applied to the mean pseudo-gradient.

Every merge algorithm is θ_{r+1} = OuterOpt(θ_r, grad=Δ) with Δ = Σᵢ wᵢΔᵢ, so
`OuterOptimizer` owns the float32 master weights θ and one torch optimizer, writes Δ into
`.grad` and calls `.step()`: the SGD, Nesterov and Adam arithmetic is torch's own.
Its state flattens to safetensors-ready tensors plus str→str metadata, and `restore`
rebuilds it so that training continues bitwise as if it had never stopped. Asynchronous
mode's outer step, `delayed_nesterov` (`delayed.py`), is one more torch optimizer here, its
momentum and buffer of pending updates part of the same state.

Streaming DiLoCo steps one fragment of the parameters a round (`step(..., names=...)`): only
those get a `.grad`, and torch's optimizers (and Yogi and the delayed Nesterov step) pass
over a parameter whose `.grad` is None, its state untouched. Their state is per parameter,
so one optimizer stepped fragment by fragment is one optimizer per fragment, each with its
own momentum (and Adam's own step count). Its saved state then covers the parameters
stepped so far (`PARTIAL_KEY` in the metadata says that some may hold none yet).

A step is checked on both sides: a Δ with NaN or Inf is refused before anything moves,
and the weights it produced (with Adam's and Yogi's moments, which the weights do not
show) are checked after, since a finite Δ can still overflow in the optimizer (Nesterov
adds the momentum to it, Adam squares it). A result that is not finite raises
`NonFiniteStep`; the optimizer then holds it, and its owner puts the last saved state back
(the coordinator reloads its last committed round), so nothing non-finite is published.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from fedtrain.errors import MergeError
from fedtrain.merge.aggregate import TensorDict, _listed, all_finite, check_compatible
from fedtrain.merge.delayed import STATE_KEYS as DELAYED_STATE
from fedtrain.merge.delayed import DelayedNesterov
from fedtrain.merge.yogi import Yogi

Move = Callable[[torch.Tensor], "torch.Tensor | None"]
"""A copy of a tensor in other memory, or None (`OuterOptimizer.move_storage`)."""

ALGORITHMS = ("fedavg", "diloco", "fedavgm", "fedadam", "fedyogi", "delayed_nesterov")

_SGD_FAMILY = ("fedavg", "diloco", "fedavgm")
_REQUIRED_HP = {
    "fedavg": ("lr",),
    "diloco": ("lr", "momentum", "nesterov"),
    "fedavgm": ("lr", "momentum", "nesterov"),
    "fedadam": ("lr", "beta1", "beta2", "eps"),
    "fedyogi": ("lr", "beta1", "beta2", "eps"),
    "delayed_nesterov": ("lr", "momentum"),
}
_ADAPTIVE_STATE = ("exp_avg", "exp_avg_sq", "step")
_SCALAR_STATE = ("step", "delay_count")  # per-parameter state that is a scalar, not the parameter's shape
_MOMENTUM = ("diloco", "fedavgm", "delayed_nesterov")  # algorithms whose state is (or holds) SGD's momentum_buffer
_FORMAT = "fedtrain.outer/1"
_METADATA_KEYS = ("format", "algorithm", "hp", "steps", "param_names")
PARTIAL_KEY = "partial"
"""Metadata key, "1" once the optimizer has stepped a subset of its parameters: then a parameter
may hold no state yet (its fragment has not synced). Absent otherwise, so the files of a run that
never steps a subset are what they were before streaming."""


class NonFiniteStep(MergeError):
    """The outer step made a weight or an optimizer moment NaN or infinite (`details["tensor"]`
    names it). The optimizer holds that result: restore its last saved state before using it."""


def _check_hp(algorithm: str, hp: Mapping[str, Any]) -> None:
    if algorithm not in ALGORITHMS:
        raise MergeError(f"unknown outer algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    missing = [k for k in _REQUIRED_HP[algorithm] if k not in hp]
    if missing:
        raise MergeError(
            f"outer hyperparameters for {algorithm} lack {', '.join(missing)}; "
            "build them with fedtrain.config.outer_defaults"
        )


def build_torch_optimizer(params: list[torch.Tensor], algorithm: str, hp: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The torch optimizer of one algorithm, configured from `outer_defaults`' dict."""
    _check_hp(algorithm, hp)
    # SGD runs fused where torch has the kernels for the weights' device (one pass over the
    # memory instead of several), else foreach. Not bitwise the same as foreach on the CPU:
    # the fused kernel rounds the last (n mod 8) elements of a tensor differently (measured up
    # to ~2e-6 after a few Nesterov steps, docs/streaming.md), so a comparison with torchft,
    # whose users pass torch's default SGD, holds to that, not bit for bit, on such tensors.
    # Both update the momentum, the gradient (Nesterov) and the parameters in place; the
    # per-tensor implementation allocates a model-sized temporary per tensor for Nesterov,
    # which would add the largest tensor to the coordinator's peak memory.
    fused = bool(params) and _fused_works(params[0].device)
    try:
        if algorithm == "fedavg":
            return torch.optim.SGD(params, lr=hp["lr"], momentum=0.0, **_impl(fused))
        if algorithm in ("diloco", "fedavgm"):
            return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], nesterov=bool(hp["nesterov"]),
                                   **_impl(fused))
        if algorithm == "delayed_nesterov":
            return DelayedNesterov(params, lr=hp["lr"], momentum=hp["momentum"], fused=fused)
        betas = (hp["beta1"], hp["beta2"])
        if algorithm == "fedadam":
            # Fused Adam: one pass over the memory and no temporaries, where the per-tensor
            # default makes several; it rounds differently from it (~1e-7 relative).
            return torch.optim.Adam(params, lr=hp["lr"], betas=betas, eps=hp["eps"], **_impl(fused))
        return Yogi(params, lr=hp["lr"], betas=betas, eps=hp["eps"])
    except ValueError as e:  # torch's own check of a hyperparameter, e.g. nesterov without momentum
        raise MergeError(f"outer optimizer {algorithm} cannot be built: {e}") from None


_FUSED: dict[str, bool] = {}


def _fused_works(device: torch.device) -> bool:
    """Whether this torch has fused SGD and Adam kernels for `device` (CPU since torch 2.4 or
    so): asked once per device type by stepping a one-element tensor with each."""
    if device.type not in _FUSED:
        try:
            for build in (lambda q: torch.optim.SGD(q, lr=0.1, momentum=0.9, nesterov=True, fused=True),
                          lambda q: torch.optim.Adam(q, lr=0.1, fused=True)):
                p = torch.zeros(1, device=device)
                p.grad = torch.ones_like(p)
                build([p]).step()
            _FUSED[device.type] = True
        except (RuntimeError, ValueError, TypeError):  # no kernel for the device, or no `fused` argument
            _FUSED[device.type] = False
    return _FUSED[device.type]


def _impl(fused: bool) -> dict[str, bool]:
    return {"fused": True} if fused else {"foreach": True}


def _expected_state_keys(algorithm: str, hp: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-parameter state keys the torch optimizer holds once it has stepped."""
    if algorithm in _SGD_FAMILY:
        return ("momentum_buffer",) if algorithm != "fedavg" and hp["momentum"] != 0 else ()
    if algorithm == "delayed_nesterov":
        return DELAYED_STATE
    return _ADAPTIVE_STATE


class OuterOptimizer:
    """Float32 master weights θ plus the outer optimizer that moves them by Δ each round.

    Memory: θ and the optimizer state (0, 1 or 2 copies); `step` sets `.grad` to the
    given tensors without copying them when dtype and device already match.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], algorithm: str, hp: Mapping[str, Any]) -> None:
        _check_hp(algorithm, hp)
        bad = [k for k, v in params.items() if not v.is_floating_point()]
        if bad:
            raise MergeError(f"outer optimizer needs floating point weights; not floating: {', '.join(bad)}")
        if not params:
            raise MergeError("outer optimizer needs at least one tensor to optimize")
        self.algorithm = algorithm
        self.hp: dict[str, Any] = dict(hp)
        self.steps = 0
        self.params: TensorDict = {
            k: v.detach().to(dtype=torch.float32, copy=True).contiguous() for k, v in params.items()
        }
        self.optimizer = build_torch_optimizer(list(self.params.values()), algorithm, self.hp)
        self.partial = False  # stepped a subset of the parameters (`PARTIAL_KEY`)

    def step(self, mean_delta: Mapping[str, torch.Tensor], divisor: float = 1.0, *, finite: bool = False,
             every: int | None = None, names: Collection[str] | None = None) -> None:
        """θ ← OuterOpt(θ, grad=Δ / divisor); Δ is consumed.

        `names`: step only these parameters (a Streaming DiLoCo fragment): Δ must hold exactly
        them, and every other parameter and its optimizer state stay as they are. None: Δ must
        hold every parameter.

        Δ's tensors become `.grad` as they are (no copy when dtype and device match), and
        torch may write into them: foreach SGD with Nesterov, torch's default on GPU, adds
        the momentum into the gradient in place. Pass the round's accumulator, not a tensor
        still needed. A refused Δ (keys, shapes, not floating, NaN/inf) changes nothing.
        A `divisor` (`RunningSum.scaled`) is applied by the fused kernels as they read the
        gradient (their `grad_scale`, bit for bit a division first), else by dividing first.
        Raises `NonFiniteStep` when the new weights or moments are not finite (see the module).
        `finite`: the caller vouches that Δ / divisor is finite (a `RunningSum` mean of updates
        checked finite: see its docstring), which saves the pass of the check before the step;
        the check after it is made all the same. `every`: the delayed Nesterov step's N from
        this step on (`merge/delayed.py`); other algorithms ignore it.
        """
        stepped = self._stepped(names)
        check_compatible(stepped, mean_delta, what="mean pseudo-gradient", check_dtype=False)
        d = float(divisor)
        if not (math.isfinite(d) and d > 0):
            raise MergeError(f"the mean pseudo-gradient's divisor must be finite and positive, got {divisor!r}")
        grads = {k: self._as_grad(k, mean_delta[k], check=d >= 1.0 and not finite) for k in stepped}
        if d < 1.0:  # a division that could overflow: done first (in place: Δ is consumed), then checked
            for name, g in grads.items():
                g.div_(d)
                if not finite and not all_finite(g):
                    raise MergeError(f"mean pseudo-gradient of {name} has NaN or infinite values; nothing was applied")
            d = 1.0
        fused = d != 1.0 and all(group.get("fused") for group in self.optimizer.param_groups)
        if d != 1.0 and not fused:
            for g in grads.values():
                g.div_(d)
        if every is not None and isinstance(self.optimizer, DelayedNesterov):
            self.optimizer.set_every(every)
        try:
            for name, g in grads.items():
                self.params[name].grad = g
            if fused:
                first = next(iter(self.params.values()))
                self.optimizer.grad_scale = torch.tensor(d, dtype=torch.float32, device=first.device)  # type: ignore[attr-defined]
            self.optimizer.step()
        finally:
            if fused:
                del self.optimizer.grad_scale  # type: ignore[attr-defined]
            for p in self.params.values():
                p.grad = None
        self.steps += 1
        self.partial = self.partial or len(stepped) < len(self.params)
        self._check_result(stepped)

    def _stepped(self, names: Collection[str] | None) -> TensorDict:
        """The parameters a step moves: all, or those of `names` (in the parameters' order)."""
        if names is None:
            return self.params
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise MergeError(f"a step of some parameters names ones the model does not have: {_listed(unknown)}")
        if not names:
            raise MergeError("a step of some parameters needs at least one of them")
        wanted = set(names)
        return {n: p for n, p in self.params.items() if n in wanted}

    def _check_result(self, stepped: Mapping[str, torch.Tensor]) -> None:
        """Raise NonFiniteStep unless every weight the step moved is finite, and Adam's and
        Yogi's moments too: a moment the weights do not show (an Inf second moment makes the
        step 0, not Inf) would hold the run still from then on. SGD's momentum shows in the
        weights."""
        for name, p in stepped.items():
            if not all_finite(p):
                raise NonFiniteStep(f"the outer step made {name} NaN or infinite; it was not applied",
                                    details={"tensor": name})
        if self.algorithm in _SGD_FAMILY:  # (the delayed step's momentum and buffer do not show yet: checked)
            return
        for name, p in stepped.items():
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and not all_finite(value):
                    raise NonFiniteStep(f"the outer step made {key} of {name} NaN or infinite; it was not applied",
                                        details={"tensor": f"{key}/{name}"})

    def _as_grad(self, name: str, delta: torch.Tensor, check: bool = True) -> torch.Tensor:
        p = self.params[name]
        if not delta.is_floating_point():
            raise MergeError(f"{name} has dtype {delta.dtype}; pseudo-gradients must be floating point")
        grad = delta.detach().to(device=p.device, dtype=p.dtype)
        if check and not all_finite(grad):
            raise MergeError(f"mean pseudo-gradient of {name} has NaN or infinite values; nothing was applied")
        return grad

    def state_tensors(self) -> TensorDict:
        """The optimizer state as `"<state_key>/<param_name>"` → tensor (live, not copies).

        Ordered by parameter, then state key, so a restored optimizer lists the same names.
        """
        out: TensorDict = {}
        for name, p in self.params.items():
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    raise MergeError(f"optimizer state {key} of {name} is not a tensor: {value!r}")
                out[f"{key}/{name}"] = value
        return out

    def move_storage(self, params: Mapping[str, Move], state: Mapping[str, Move]) -> None:
        """Give master weights (`params`, by name) and optimizer state tensors (`state`, by their
        `state_tensors` name) the storage `move(tensor)` returns, a tensor of the same values
        (None: the tensor stays where it is); names not held here are skipped. The weights
        keep their identity (the optimizer's state is keyed by them): their `.data` is replaced.
        A state tensor is replaced in the optimizer's state; its `move` may give the old memory
        back, so the caller makes sure that no other optimizer shares it (`restore` may adopt
        the tensors it is given)."""
        for name, move in params.items():
            p = self.params.get(name)
            moved = move(p) if p is not None else None
            if p is not None and moved is not None:
                p.data = moved
        for flat, move in state.items():
            key, _, name = flat.partition("/")
            p = self.params.get(name)
            slot = self.optimizer.state.get(p) if p is not None else None
            value = slot.get(key) if slot is not None else None
            if slot is not None and isinstance(value, torch.Tensor):
                moved = move(value)
                if moved is not None:
                    slot[key] = moved

    def state_metadata(self) -> dict[str, str]:
        """Everything besides tensors that `restore` needs, as str → str (JSON inside)."""
        try:
            hp = json.dumps(self.hp, sort_keys=True)
        except TypeError as e:
            raise MergeError(f"outer hyperparameters cannot be saved as JSON: {e}") from None
        meta = {
            "format": _FORMAT,
            "algorithm": self.algorithm,
            "hp": hp,
            "steps": str(self.steps),
            "param_names": json.dumps(list(self.params)),
        }
        if self.partial:
            meta[PARTIAL_KEY] = "1"
        return meta

    @classmethod
    def restore(
        cls,
        params: Mapping[str, torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str],
    ) -> OuterOptimizer:
        """Rebuild from the master weights and the output of state_tensors/state_metadata."""
        algorithm, hp, steps, names = _parse_metadata(metadata)
        missing = [n for n in names if n not in params]
        unexpected = [n for n in params if n not in names]
        if missing or unexpected:
            raise MergeError(
                "weights given to restore do not match the saved optimizer state: "
                f"missing keys: {_listed(missing) or 'none'}; "
                f"unexpected keys: {_listed(unexpected) or 'none'}"
            )
        # safetensors hands tensors back sorted by name; keep the order of the saved run.
        outer = cls({n: params[n] for n in names}, algorithm, hp)
        outer.partial = metadata.get(PARTIAL_KEY) == "1"
        state = _unflatten_state(outer.params, tensors, _expected_state_keys(algorithm, hp), steps, outer.partial)
        param_groups = outer.optimizer.state_dict()["param_groups"]
        outer.optimizer.load_state_dict({"state": state, "param_groups": param_groups})
        outer.steps = steps
        return outer

    def switched(self, algorithm: str, hp: Mapping[str, Any]) -> OuterOptimizer:
        """The same weights under `algorithm`: with SGD's momentum carried over where both this
        optimizer and the new one hold one (diloco and fedavgm to the delayed Nesterov step of
        asynchronous mode and back: the momentum means the same in both), else fresh state.
        The delayed step's buffer of updates not yet in the momentum is dropped on the way out
        (those updates are already in the weights; only their share of the momentum is lost)."""
        _check_hp(algorithm, hp)
        keys = _expected_state_keys(algorithm, hp)
        state = self.state_tensors()
        carried = self.algorithm in _MOMENTUM and algorithm in _MOMENTUM and "momentum_buffer" in keys
        if not carried or self.steps == 0 or not any(k.startswith("momentum_buffer/") for k in state):
            return OuterOptimizer(self.params, algorithm, hp)
        tensors: TensorDict = {}
        for name, p in self.params.items():
            if f"momentum_buffer/{name}" not in state:  # stepped in fragments: this one's has not synced yet
                continue
            tensors[f"momentum_buffer/{name}"] = state[f"momentum_buffer/{name}"].detach().clone()
            if algorithm == "delayed_nesterov":
                tensors[f"delay_buffer/{name}"] = torch.zeros_like(p)
                tensors[f"delay_count/{name}"] = torch.tensor(0.0, dtype=torch.float32)
        meta = {**self.state_metadata(), "algorithm": algorithm, "hp": json.dumps(dict(hp), sort_keys=True)}
        return OuterOptimizer.restore(self.params, tensors, meta)


def _parse_metadata(metadata: Mapping[str, str]) -> tuple[str, dict[str, Any], int, list[str]]:
    missing = [k for k in _METADATA_KEYS if k not in metadata]
    if missing:
        raise MergeError(
            f"outer optimizer metadata lacks {', '.join(missing)}; it must come from OuterOptimizer.state_metadata()"
        )
    if metadata["format"] != _FORMAT:
        raise MergeError(f"outer optimizer state has format {metadata['format']!r}, expected {_FORMAT!r}")
    try:
        hp = json.loads(metadata["hp"])
        names = json.loads(metadata["param_names"])
        steps = int(metadata["steps"])
    except ValueError as e:
        raise MergeError(f"outer optimizer metadata is corrupt: {e}") from None
    if not isinstance(hp, dict) or not isinstance(names, list) or steps < 0:
        raise MergeError("outer optimizer metadata is corrupt: hp, param_names or steps has the wrong type")
    _check_hp(metadata["algorithm"], hp)
    return metadata["algorithm"], hp, steps, names


def _unflatten_state(
    params: TensorDict, tensors: Mapping[str, torch.Tensor], keys: tuple[str, ...], steps: int, partial: bool = False
) -> dict[int, dict[str, torch.Tensor]]:
    """`{"key/name": t}` back to torch's `{param_index: {key: t}}`, checked for completeness:
    every parameter holds all of `keys` once stepped, or (`partial`: stepped in fragments) all
    or none of them."""
    index = {name: i for i, name in enumerate(params)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for flat, value in tensors.items():
        key, _, name = flat.partition("/")
        if key not in keys or name not in index:
            raise MergeError(f"outer optimizer state has an unexpected tensor {flat!r}")
        if key not in _SCALAR_STATE and tuple(value.shape) != tuple(params[name].shape):
            raise MergeError(
                f"outer optimizer state {flat} has shape {tuple(value.shape)}, expected {tuple(params[name].shape)}"
            )
        state.setdefault(index[name], {})[key] = value
    if partial:
        holding = {flat.partition("/")[2] for flat in tensors}  # (each tensor's key and name checked above)
        absent = [f"{k}/{n}" for n in params if n in holding for k in keys if f"{k}/{n}" not in tensors]
        if absent:
            raise MergeError(f"outer optimizer state is incomplete: missing {_listed(absent)}")
        return state
    want = len(keys) * len(params) if steps > 0 else 0
    if len(tensors) != want:
        absent = [f"{k}/{n}" for n in params for k in keys if f"{k}/{n}" not in tensors]
        raise MergeError(
            f"outer optimizer state after {steps} steps should hold {want} tensors, found "
            f"{len(tensors)}" + (f"; missing {_listed(absent)}" if absent else "")
        )
    return state
