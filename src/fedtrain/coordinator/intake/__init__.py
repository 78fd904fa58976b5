"""How an update gets in: admission (`uploads`), receiving its bytes into a spool file
(`receive`, `spool`), checks of its values, updates in pieces, and its place in the open
round's sum (`flow`, `tickets`, `folds`). See docs/architecture.md."""
