"""The numeric bounds of the run config's fields: the ranges a value may take, shared by the
config's sections (`run_config`, `model_config`) and re-exported by `fedtrain.config` for the
coordinator's own checks (`MB`, `MAX_UPDATE_TOKENS`). Each bound says why it is where it is."""

from __future__ import annotations

MB = 1_000_000
"""The megabyte of `max_upload_mb`, as the coordinator counts it."""
MIN_UPLOAD_MB = 0.01
"""The smallest `max_upload_mb`: 10 kB, the header and data of a toy model's update."""
MAX_UPLOAD_MB = 1_000_000.0
"""The largest `max_upload_mb`: 1 TB."""
MAX_SECONDS = 366 * 86400.0
"""The longest duration a field may name (a year): longer is a typo, and `threading` waits
refuse timeouts beyond `threading.TIMEOUT_MAX`."""
MIN_HEARTBEAT_S = 0.05
"""The shortest heartbeat interval: shorter makes each participant a busy loop of requests."""
MAX_LR = 10.0
"""The largest learning rate, inner or outer: above it every step diverges."""
SEED_RANGE = (-(2**63), 2**63 - 2)
"""Seeds `torch.manual_seed` takes, with the `seed + 1` a recipe derives from it."""
MAX_UPDATE_TOKENS = 2**40
"""The most tokens one update may count for (~1.1e12): a round's schedule times
`outer.token_slack` beyond it is refused, so that token sums stay far below 2^53 (exact as
floats, and in SQLite's 64-bit integers) for 8,192 of the largest updates."""
MAX_STEPS = 1_000_000
"""The most inner steps (train.sync_every) and the most sequences per step (batch_size)."""
MAX_TOKENS = 2**20
"""The longest sequence, and the longest context of the built-in GPT: 1,048,576 tokens."""
MAX_COUNT = 1_000_000
"""The largest count a config field takes where no other bound applies (participants, batches,
windows, staleness): far beyond any run, far below the 2^53 where sums stop being exact."""

