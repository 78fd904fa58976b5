"""The `fedtrain` command: its arguments (`parser`), running a command (`commands`), the admin commands
(`admin_commands`: config, roll back), the local demo run (`demo`) and the text tables of
status and evals (`report`). `run` is the console script's entry point: `main`, then the exit."""

from __future__ import annotations

from fedtrain.cli.commands import main, run
from fedtrain.cli.parser import build_parser

__all__ = ["build_parser", "main", "run"]
