"""The ranks of a participant: how a process, a DDP group or an FSDP group shares one sync (the
roles), the control messages between its ranks (on a gloo group of their own), which rows an FSDP
rank holds, and running under torchrun. See docs/architecture.md."""
