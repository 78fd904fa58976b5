"""Prometheus exposition: valid text format, histograms that add up, escaped labels."""

from __future__ import annotations

import re

from fedtrain.coordinator.http.prometheus import MERGE_BUCKETS, ROUND_BUCKETS, render

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? (\S+)$')


def status(**over: object) -> dict:
    base: dict = {
        "run": 'my "run"\nx', "algorithm": "diloco", "current_round": 3, "rounds": 10, "finished": False,
        "config_version": 2, "latest_config_version": 3, "parameters": 1000, "model_bytes": 4000,
        "bytes_in": 12345, "bytes_out": 67890, "submitted": ["a"],
        "participants": [
            {"id": "a", "state": "active", "tokens": 100, "bytes_up": 10, "bytes_down": 20, "tokens_per_s": 50.5,
             "loss": 2.5, "config_version": 2, "last_seen": 1700000000.25},
            {"id": "b", "state": "failed", "tokens": 60, "bytes_up": 5, "bytes_down": 20, "tokens_per_s": None,
             "loss": None, "config_version": None, "last_seen": 1700000000.0},
        ],
    }
    base.update(over)
    return base


def parse(text: str) -> dict[str, float]:
    """name{labels} -> value; fails on any line that is not a valid sample or comment."""
    assert text.endswith("\n")
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram"} and name not in typed, line
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a valid sample line: {line!r}"
        key, value = line.rsplit(" ", 1)
        assert key not in out, f"duplicate sample {key}"
        out[key] = float(value)
        assert re.sub(r"_(bucket|sum|count)$", "", m.group(1)) in typed, f"sample without a TYPE: {line}"
    return out


def test_render_is_valid_exposition_with_the_run_figures() -> None:
    timings = [(3.0, 0.02), (12.0, 0.2), (700.0, 4.0)]
    m = parse(render(status(), timings, subscribers=4))
    assert m["fedtrain_rounds_committed_total"] == 3 and m["fedtrain_current_round"] == 3
    assert m['fedtrain_participants{state="active"}'] == 1 and m['fedtrain_participants{state="failed"}'] == 1
    assert m['fedtrain_participants{state="evicted"}'] == 0
    assert m["fedtrain_bytes_received_total"] == 12345 and m["fedtrain_bytes_sent_total"] == 67890
    assert m["fedtrain_config_version"] == 2 and m["fedtrain_config_latest_version"] == 3
    assert m["fedtrain_stream_subscribers"] == 4 and m["fedtrain_tokens_total"] == 160
    assert m['fedtrain_participant_tokens_per_second{participant="a"}'] == 50.5
    assert 'fedtrain_participant_loss{participant="b"}' not in m  # unknown values are left out, not 0
    assert m["fedtrain_last_round_duration_seconds"] == 700 and m["fedtrain_last_merge_seconds"] == 4
    assert m['fedtrain_participant_last_seen_timestamp_seconds{participant="a"}'] == 1700000000.25


def test_histograms_are_cumulative_and_add_up() -> None:
    timings = [(0.5, 0.001), (3.0, 0.02), (12.0, 0.2), (7200.0, 40.0)]
    m = parse(render(status(), timings))
    for name, bounds, values in [
        ("fedtrain_round_duration_seconds", ROUND_BUCKETS, [d for d, _ in timings]),
        ("fedtrain_merge_seconds", MERGE_BUCKETS, [s for _, s in timings]),
    ]:
        counts = [m[f'{name}_bucket{{le="{b if b != int(b) else int(b)}"}}'] for b in bounds]
        assert counts == sorted(counts)
        assert counts == [sum(v <= b for v in values) for b in bounds]
        assert m[f'{name}_bucket{{le="+Inf"}}'] == m[f"{name}_count"] == len(values)
        assert abs(m[f"{name}_sum"] - sum(values)) < 1e-9


def test_labels_are_escaped_and_an_empty_run_renders() -> None:
    text = render(status(participants=[], submitted=[]), [])
    assert 'run="my \\"run\\"\\nx"' in text
    m = parse(text)
    assert m['fedtrain_round_duration_seconds_bucket{le="+Inf"}'] == 0
    assert "fedtrain_last_round_duration_seconds" not in text


def test_world_size_per_participant_with_its_parallelism() -> None:
    base = {"state": "active", "tokens": 1, "bytes_up": 0, "bytes_down": 0}
    rows = [{**base, "id": "f", "parallel": "fsdp", "world_size": 2},
            {**base, "id": "s", "parallel": "single", "world_size": 1},
            {**base, "id": "u", "parallel": None, "world_size": 8},
            {**base, "id": "n", "parallel": None, "world_size": None}]
    m = parse(render(status(participants=rows), []))
    assert m['fedtrain_participant_world_size{participant="f",parallel="fsdp"}'] == 2
    assert m['fedtrain_participant_world_size{participant="s",parallel="single"}'] == 1
    assert m['fedtrain_participant_world_size{participant="u",parallel="unknown"}'] == 8
    assert not any('participant="n"' in k for k in m if k.startswith("fedtrain_participant_world_size"))
    assert "fedtrain_participant_world_size" not in render(status(), [])  # a status without it: no family
