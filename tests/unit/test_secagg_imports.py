"""`import fedtrain` and `import fedtrain.privacy` need neither `cryptography` nor `dp-accounting`;
using a part that needs one without it is a ConfigError naming the `privacy` extra."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_package_loads_neither_optional_dependency() -> None:
    r = _run(
        "import sys, fedtrain, fedtrain.privacy\n"
        "fedtrain.privacy.FixedPoint; fedtrain.privacy.RoundSetup\n"
        "print([m for m in ('cryptography', 'dp_accounting', 'scipy') if m in sys.modules])"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "blocked, use",
    [
        ("cryptography", "from fedtrain.privacy import ParticipantKeys; ParticipantKeys.generate(1)"),
        (
            "dp_accounting",
            "from fedtrain.privacy import DpSettings, epsilon_after; "
            "epsilon_after(DpSettings(1.0, 1e-5, 10.0, 10), 10)",
        ),
    ],
)
def test_a_missing_extra_is_a_config_error_naming_it(blocked: str, use: str) -> None:
    r = _run(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from fedtrain.errors import ConfigError\n"
        f"try:\n    {use}\nexcept ConfigError as e:\n    print('refused:', e)\n"
    )
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "fedtrain[privacy]" in r.stdout
