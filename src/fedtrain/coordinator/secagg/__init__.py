"""Secure aggregation in a run (issue #33): the coordinator's side of each round's masking protocol.

`phases.py` holds the pure decisions (when a phase closes, the round's threshold and ring),
`attempt.py` one attempt's state (keys, relayed shares, the ring sum, the revealed shares) on top
of `fedtrain.privacy.SecAggCoordinator`, and `runner.py` the run's `SecureAggregation`, which the
round loop (`rounds/progress.py`), the intake (`intake/flow.py`) and the routes
(`http/routes/secagg.py`) talk to. docs/privacy.md, "Secure aggregation in runs".
"""

from fedtrain.coordinator.secagg.phases import PHASES, SecAggRefused
from fedtrain.coordinator.secagg.runner import SecureAggregation

__all__ = ["PHASES", "SecAggRefused", "SecureAggregation"]
