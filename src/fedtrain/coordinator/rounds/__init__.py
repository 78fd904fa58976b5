"""How the run moves on: the open round and its clock, closing, merging and committing it
(`progress`), the inner steps each participant is told (`schedule`) and the Streaming DiLoCo
fragment plan. See docs/architecture.md."""
