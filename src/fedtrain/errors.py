"""The exception tree of fedtrain: every error a user can meet, with a message they can act on.

    FedtrainError
    ├── ConfigError            a config file or field is missing or invalid
    ├── WireError              a tensor body is malformed, truncated or fails its digest
    ├── MergeError             tensors that cannot be merged (keys, shapes, dtypes, values)
    │   └── ModelMismatchError a participant's model does not match the run's model
    ├── StateError             the coordinator's state directory is unusable
    ├── Refused                the coordinator turns a request down, with the HTTP status and code to answer
    └── CoordinatorError       the coordinator answered with an error (status, code, message)
        ├── AuthError          401/403: missing, wrong or insufficient token
        ├── RoundClosedError   409: the round is over (or, asynchronous, the update too stale); move on to
        │                      the current global model
        ├── CoordinatorUnavailable  no answer after bounded retries (refused, timeouts, 5xx)
        ├── NotACoordinatorError    something answers at the address, but not a fedtrain coordinator
        └── TLSError           https against plain HTTP or the reverse, or a certificate not trusted

AuthError, NotACoordinatorError and TLSError are permanent: retrying cannot fix them, so the
client raises them at once, with the setting to change in the message.

`Refused` is raised on the server side (by the service and its routes) and answered as it is;
a client meets it as a `CoordinatorError` with the same status and code.

Low-level errors (httpx, starlette, safetensors, sqlite3) are translated into this tree at
one boundary each: `participant/client/coordinator_client.py` on the client side, `coordinator/app.py` on the
server side (which answers every error with the JSON shape of `error_body`).
"""

from __future__ import annotations

from typing import Any


class FedtrainError(Exception):
    """Base class of every error fedtrain raises on purpose."""

    code = "error"

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class ConfigError(FedtrainError):
    code = "invalid_config"


class WireError(FedtrainError):
    code = "invalid_body"


class MergeError(FedtrainError):
    code = "incompatible_update"


class ModelMismatchError(MergeError):
    code = "model_mismatch"


class StateError(FedtrainError):
    code = "state_error"


class Refused(FedtrainError):
    """A request the coordinator refuses, with the HTTP status and code to answer with."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details=details)
        self.status = status
        self.code = code


class CoordinatorError(FedtrainError):
    """The coordinator refused a request; `status` and `code` come from its JSON error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        code: str = "error",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, details=details)
        self.status = status
        self.code = code


class AuthError(CoordinatorError):
    pass


class RoundClosedError(CoordinatorError):
    pass


class CoordinatorUnavailable(CoordinatorError):
    pass


class NotACoordinatorError(CoordinatorError):
    """The address answers, but not as a fedtrain coordinator (an HTML page, a 404 on /v1/join)."""


class TLSError(CoordinatorError):
    """TLS does not match at the address (https to a plain-HTTP port or the reverse), or its
    certificate cannot be verified."""


def error_body(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> dict:
    """The one JSON shape of every 4xx/5xx answer of the coordinator."""
    return {"error": {"status": status, "code": code, "message": message, "details": details or {}}}
