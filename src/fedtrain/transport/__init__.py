"""PLACEHOLDER until the transport package lands (replaced at merge)."""

import os


def fast_io_enabled() -> bool:
    return os.environ.get("FEDTRAIN_FAST_IO", "1").strip().lower() not in ("0", "off", "false", "no")
