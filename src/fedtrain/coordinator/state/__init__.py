"""What the coordinator keeps of a run: the SQLite store, the event log and its stream, the
config versions, the state directory's lock and how a full disk is told apart. See
docs/architecture.md."""
