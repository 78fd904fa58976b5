"""The coordinator's own evaluation of the global model, on the eval set its config names.

More: docs/architecture.md, "coordinator/model/global_eval.py".
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.state.store import Store

__all__ = ["GLOBAL_EVAL_PREFIX", "GlobalEvaluator", "version_due"]

log = logging.getLogger("fedtrain.coordinator")

GLOBAL_EVAL_PREFIX = "global_eval/"


def version_due(version: int, config: RunConfig) -> bool:
    """Whether global version `version` is evaluated: the initial one, every `eval.every`-th round's, the last."""
    if version == 0:
        return True
    r = version - 1
    return r % config.eval.every == 0 or (config.rounds > 0 and version >= config.rounds)


class GlobalEvaluator:
    """A daemon thread beside the coordinator's event loop; `start()` and `stop()` with the service.
    It reads the config in force (`config()`), the committed version and the committed files,
    and writes metrics and events to the store (which serializes its writers)."""

    def __init__(self, store: Store, committer: Committer, config: Callable[[], RunConfig],
                 poll_s: float = 0.5) -> None:
        self._store = store
        self._committer = committer
        self._config = config
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 0  # the first version not looked at yet
        self._done: set[int] = set()
        self._model: torch.nn.Module | None = None
        self._loaded: tuple[str, Any] | None = None  # (data spec, batches source)

    def start(self) -> None:
        # After a restart, versions evaluated before are not evaluated again.
        self._done = {m["round"] for m in self._store.metrics(GLOBAL_EVAL_PREFIX + "loss")}
        self._thread = threading.Thread(target=self._run, name="fedtrain-global-eval", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            config = self._config()
            if config.eval.global_data is None:
                continue
            kept = set(self._committer.ckpt.versions())
            for version in range(self._next, self._committer.committed_version + 1):
                if self._stop.is_set():
                    return
                self._next = version + 1
                if version in kept and version not in self._done and version_due(version, config):
                    self._evaluate_and_store(version, config)

    def _evaluate_and_store(self, version: int, config: RunConfig) -> None:
        try:
            values = self.evaluate(version, config)
        except Exception as e:  # an eval problem must never take the coordinator down
            log.exception("global evaluation of version %d failed", version)
            self._report_failure(version, e)
            return
        if not self._stop.is_set():
            self._store.add_metrics(None, version, None, values)
            log.info("global eval of version %d: loss %.4f", version, values[GLOBAL_EVAL_PREFIX + "loss"])

    def _report_failure(self, version: int, error: Exception) -> None:
        try:
            self._store.add_event("global_eval", f"evaluation of global version {version} failed: {error}")
        except Exception:  # noqa: BLE001 - the store may be closing with the service
            log.debug("could not record the failed global evaluation")

    def evaluate(self, version: int, config: RunConfig) -> dict[str, float]:
        """Held-out loss and perplexity of global `version` on `config.eval.global_data`."""
        from fedtrain.recipes.build import build_model, loss_fn
        from fedtrain.recipes.data import evaluate

        model = self._model
        if model is None:
            model = self._model = build_model(config.model, seed=config.seed)
        stream = self._stream(config)
        params = self._committer.ckpt.load_global(version, self._store.get_meta(f"digest/{version}"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(params[name])
        loss = evaluate(model, stream.eval_batches(config.eval.global_batches), loss_fn(config.model))
        return {GLOBAL_EVAL_PREFIX + "loss": loss, GLOBAL_EVAL_PREFIX + "ppl": math.exp(min(loss, 50.0))}

    def _stream(self, config: RunConfig) -> Any:
        from fedtrain.recipes.build import load_data, tokenizer_of
        from fedtrain.recipes.data import TokenStream, parse_data_spec

        spec = config.eval.global_data
        assert spec is not None
        if self._loaded is None or self._loaded[0] != spec:
            tokens = load_data(config.model, parse_data_spec(spec), tokenizer_of(config.model))
            self._loaded = (spec, tokens)
        t = config.train
        return TokenStream(self._loaded[1], batch_size=t.batch_size, seq_len=t.seq_len, seed=0, heldout_fraction=0.5)
