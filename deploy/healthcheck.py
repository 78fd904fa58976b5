"""The container's health check: exit 0 when the coordinator answers GET /v1/healthz, 1 otherwise.

The URL is $FEDTRAIN_HEALTH_URL, by default the coordinator's port on loopback inside the
container. Over https the certificate is not checked: this only asks whether the process in
this container answers, on 127.0.0.1, where no certificate names the address.
Stdlib only (it runs in the image, beside fedtrain, with no other dependency).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/v1/healthz"
TIMEOUT_S = 5.0


def healthy(url: str) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as response:
            return response.status == 200 and json.load(response).get("ok") is True
    except (OSError, ValueError) as e:
        print(f"fedtrain health check: {url}: {e}", file=sys.stderr)
        return False


if __name__ == "__main__":
    sys.exit(0 if healthy(os.environ.get("FEDTRAIN_HEALTH_URL", DEFAULT_URL)) else 1)
