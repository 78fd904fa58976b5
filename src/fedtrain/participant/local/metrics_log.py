"""A participant's metrics on local disk: JSON lines always, TensorBoard when it is installed.

One record per round (what `Participant.history` holds: train loss, evals before and
after the sync, tokens, sync time, bytes) is appended to `DIR/metrics.jsonl` with a
timestamp, and flushed at once so that `tail -f` and a crash both see it. When
`torch.utils.tensorboard` can be imported (the `tensorboard` package is installed), every
numeric field is also written as a scalar under `DIR/tensorboard`, stepped by round.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog"]

log = logging.getLogger("fedtrain.participant")


class MetricsLog:
    """Append-only metrics of one participant in its run directory."""

    def __init__(self, directory: str | Path, *, tensorboard: bool = True) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.debug("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard event files are being written."""
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (JSON-able values); numeric ones also go to TensorBoard."""
        line = {"ts": round(time.time(), 3), **record}
        self._file.write(json.dumps(line, default=str) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record.get("round", 0))
            for key, value in record.items():
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                if key != "round" and numeric and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
