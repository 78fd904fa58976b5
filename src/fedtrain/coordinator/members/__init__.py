"""Who takes part: the roster, the tokens and credentials that say who may act (`auth`),
a participant's processes as its join describes them, and how the status shows one. See
docs/architecture.md."""
