"""Prometheus text exposition (format 0.0.4) of a coordinator's state, written by hand.

`render` is pure: it turns the status snapshot (`Coordinator.status()`), the timings of
every committed round and a few counters into the text a Prometheus scraper reads at
`GET /metrics`. Nothing here reads a clock, a socket or the database, so the output is
tested from plain dicts.

More: docs/architecture.md, "coordinator/http/prometheus.py".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from fedtrain.coordinator import policy

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Bucket upper bounds, in seconds: a round lasts from seconds (the demo) to an hour.
ROUND_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: A merge (outer step + checkpoint write) takes milliseconds for small models, seconds for big ones.
MERGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STATES = (policy.ACTIVE, policy.FAILED, policy.LEFT, policy.EVICTED)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self.lines.append(f"{name}{_labels(labels or {})} {_number(value)}")

    def metric(self, name: str, kind: str, help_: str, value: float, labels: dict[str, str] | None = None) -> None:
        self.family(name, kind, help_)
        self.sample(name, value, labels)

    def histogram(self, name: str, help_: str, values: Sequence[float], buckets: Iterable[float]) -> None:
        self.family(name, "histogram", help_)
        for bound in buckets:
            self.sample(f"{name}_bucket", sum(1 for v in values if v <= bound), {"le": _number(bound)})
        self.sample(f"{name}_bucket", len(values), {"le": "+Inf"})
        self.sample(f"{name}_sum", sum(values))
        self.sample(f"{name}_count", len(values))

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(status: dict[str, Any], timings: Sequence[tuple[float, float]], subscribers: int = 0) -> str:
    """The exposition text. `timings` holds (duration_s, merge_s) of every committed round."""
    w = _Writer()
    w.metric("fedtrain_info", "gauge", "The run served by this coordinator (value is always 1).", 1,
             {"run": status["run"], "algorithm": status["algorithm"]})
    w.metric("fedtrain_current_round", "gauge", "The open round (= the global model version).",
             status["current_round"])
    w.metric("fedtrain_rounds_committed_total", "counter", "Rounds merged and committed since the run began.",
             len(timings))
    w.metric("fedtrain_rounds_planned", "gauge", "Rounds until the run is finished (0: no end).", status["rounds"])
    w.metric("fedtrain_run_finished", "gauge", "1 once the run has finished.", int(bool(status["finished"])))
    w.metric("fedtrain_round_submissions", "gauge", "Updates received for the open round.", len(status["submitted"]))

    states = {s: 0 for s in STATES}
    for p in status["participants"]:
        states[p["state"]] = states.get(p["state"], 0) + 1
    w.family("fedtrain_participants", "gauge", "Participants of the run by state.")
    for state, n in states.items():
        w.sample("fedtrain_participants", n, {"state": state})

    w.metric("fedtrain_bytes_received_total", "counter",
             "Update bytes received from participants since the run began.", status["bytes_in"])
    w.metric("fedtrain_bytes_sent_total", "counter",
             "Model bytes sent to participants since the run began.", status["bytes_out"])
    w.metric("fedtrain_tokens_total", "counter", "Tokens processed by all participants in submitted rounds.",
             sum(p["tokens"] for p in status["participants"]))

    durations = [d for d, _ in timings]
    merges = [m for _, m in timings]
    w.histogram("fedtrain_round_duration_seconds", "Committed rounds: time from opening to closing.",
                durations, ROUND_BUCKETS)
    w.histogram("fedtrain_merge_seconds", "Committed rounds: outer step and checkpoint write.", merges, MERGE_BUCKETS)
    if timings:
        w.metric("fedtrain_last_round_duration_seconds", "gauge", "Duration of the last committed round.",
                 durations[-1])
        w.metric("fedtrain_last_merge_seconds", "gauge", "Merge time of the last committed round.", merges[-1])

    w.metric("fedtrain_config_version", "gauge", "Config version in force for the open round.",
             status["config_version"])
    w.metric("fedtrain_config_latest_version", "gauge", "Newest accepted config version (may start next round).",
             status["latest_config_version"])
    w.metric("fedtrain_model_parameters", "gauge", "Parameters in the sync set.", status["parameters"])
    w.metric("fedtrain_model_bytes", "gauge", "Bytes of the global model's sync set.", status["model_bytes"])
    w.metric("fedtrain_stream_subscribers", "gauge", "Open server-sent-event streams (participants, dashboards).",
             subscribers)

    per_participant: list[tuple[str, str, str, str]] = [
        ("fedtrain_participant_tokens_total", "counter", "Tokens a participant processed in submitted rounds.",
         "tokens"),
        ("fedtrain_participant_bytes_up_total", "counter", "Update bytes a participant uploaded.", "bytes_up"),
        ("fedtrain_participant_bytes_down_total", "counter", "Model bytes a participant downloaded.", "bytes_down"),
        ("fedtrain_participant_tokens_per_second", "gauge", "Throughput a participant last reported.",
         "tokens_per_s"),
        ("fedtrain_participant_loss", "gauge", "Training loss a participant last reported.", "loss"),
        ("fedtrain_participant_config_version", "gauge", "Config version a participant runs.", "config_version"),
        ("fedtrain_participant_last_seen_timestamp_seconds", "gauge", "Unix time of a participant's last contact.",
         "last_seen"),
    ]
    for name, kind, help_, key in per_participant:
        rows = [(p["id"], p[key]) for p in status["participants"] if p.get(key) is not None]
        if not rows:
            continue
        w.family(name, kind, help_)
        for pid, value in rows:
            w.sample(name, float(value), {"participant": pid})
    ranked = [p for p in status["participants"] if p.get("world_size") is not None]
    if ranked:
        w.family("fedtrain_participant_world_size", "gauge",
                 "Ranks a participant trains on; parallel: single, ddp, fsdp (unknown: not said).")
        for p in ranked:
            w.sample("fedtrain_participant_world_size", p["world_size"],
                     {"participant": p["id"], "parallel": p.get("parallel") or "unknown"})
    return w.text()
