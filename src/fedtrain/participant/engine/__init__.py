"""The participant engine: the `Participant` a training loop steps, the schedule of its syncs, each
rank's `SyncEngine` (Δ up, θ down), the round's records, riding out outages, the loop's pace.
See docs/architecture.md."""
