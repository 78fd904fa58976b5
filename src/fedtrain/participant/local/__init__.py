"""A participant's local state: its checkpoint at round boundaries (one process, or every rank of
an FSDP group through torch.distributed.checkpoint) and its metrics log. See docs/architecture.md."""
