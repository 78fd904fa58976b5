"""benchmarks/gpu_check.py on a GPU: a DDP and an FSDP participant under torchrun on NCCL (one rank
per GPU), the loss falls and every rank ends on the served model. Skipped without CUDA; the same
check runs on gloo with 2 ranks in the default run (test_torchrun.py, test_fsdp.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_ddp_and_fsdp_participants_train_on_nccl_and_end_on_the_served_model() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--ranks", "1"], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_check: all checks passed" in done.stdout
