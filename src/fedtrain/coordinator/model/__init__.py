"""The global model: the committer (master weights and outer optimizer), checkpoints on
disk, serving it whole or in rows, going back to a kept version, and the coordinator's own
evaluation of it. See docs/architecture.md."""
