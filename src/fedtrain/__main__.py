"""`python -m fedtrain` is the `fedtrain` command."""

from fedtrain.cli import run

run()
