"""`fedtrain status` with central DP: a privacy line with (ε, δ), the rounds, the budget and the
settings; none without DP."""

from __future__ import annotations

from fedtrain.cli.report import privacy_lines, secagg_line

RECORD = {"mechanism": "central", "epsilon": 3.21456, "delta": 1e-5, "rounds": 7, "budget": 8.0,
          "over_budget": False, "noise_multiplier": 1.5, "clip_norm": 0.5, "accountant": "dp-accounting rdp"}


def test_the_privacy_line_says_epsilon_delta_rounds_and_budget() -> None:
    line = privacy_lines(RECORD)
    assert "(ε, δ) = (3.215, 1e-05) after 7 rounds (budget ε 8)" in line
    assert "σ 1.5, C 0.5, dp-accounting rdp" in line and "OVER" not in line
    assert "OVER BUDGET" in privacy_lines({**RECORD, "epsilon": 9.0, "over_budget": True})
    assert "no budget" in privacy_lines({**RECORD, "budget": None})


def test_no_dp_no_line() -> None:
    assert privacy_lines(None) == "" and privacy_lines({}) == ""


def test_the_status_names_distributed_dp_and_secure_aggregations_phase() -> None:
    assert "privacy: distributed DP" in privacy_lines({**RECORD, "mechanism": "distributed"})
    line = secagg_line({"round": 3, "session": "s", "phase": "upload", "reason": "waiting for 1 upload",
                        "participants": 4, "sharing": 4, "uploaded": 3, "threshold": 3, "ring_bits": 16,
                        "refused_attempts": 1})
    assert "secure aggregation: round 3, phase upload (3 of 4 sharing uploaded, 4 advertised, t = 3, 2^16 ring)" \
        in line and "1 attempt refused" in line and "waiting for 1 upload" in line
    assert secagg_line(None) == ""
