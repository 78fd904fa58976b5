"""Scripts that torchrun runs on every rank of a test's group (see `tests.helpers.torchrun`)."""
