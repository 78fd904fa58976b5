"""OpenAPI links between the routes of a participant's life: what a join answers (its id and
key, the current round) is what its heartbeats, uploads, round polls and leave take. They
document the flow in /v1/openapi.json, and let a stateful fuzzer (schemathesis) walk it:
join -> upload -> round status -> leave (tests/integration/test_fuzz.py).

More: docs/architecture.md, "coordinator/http/routes/links.py".
"""

from __future__ import annotations

from typing import Any

from fedtrain.coordinator.members.auth import KEY_HEADER


def _ref(path: str, method: str) -> str:
    """A JSON pointer to an operation of the document (`operationRef`): '/' as '~1'."""
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


HEARTBEAT = _ref("/v1/participants/{pid}/heartbeat", "post")
LEAVE = _ref("/v1/participants/{pid}/leave", "post")
UPLOAD = _ref("/v1/rounds/{round_}/updates/{pid}", "put")
ROUND = _ref("/v1/rounds/{round_}", "get")


def _as(pid: str, key: str) -> dict[str, str]:
    return {"path.pid": pid, f"header.{KEY_HEADER}": key}


def _links(**links: tuple[str, dict[str, str]]) -> dict[int | str, dict[str, Any]]:
    """A route's `responses` with `links` on its 200."""
    named = {name: {"operationRef": ref, "parameters": params} for name, (ref, params) in links.items()}
    return {200: {"links": named}}


_JOINED = _as("$response.body#/participant_id", "$response.body#/participant_key")
JOIN_LINKS = _links(
    Heartbeat=(HEARTBEAT, _JOINED),
    Upload=(UPLOAD, {**_JOINED, "path.round_": "$response.body#/current_round"}),
    Leave=(LEAVE, _JOINED),
)
"""What a join's answer leads to: the participant acting as itself."""

_UPLOADER = {"path.round_": "$request.path.round_", "query.participant_id": "$request.path.pid",
             f"header.{KEY_HEADER}": f"$request.header.{KEY_HEADER}"}
UPLOAD_LINKS = _links(RoundStatus=(ROUND, _UPLOADER))
"""After an upload: the round it went into, polled as its participant."""

ROUND_LINKS = _links(Leave=(LEAVE, _as("$request.query.participant_id", f"$request.header.{KEY_HEADER}")))
"""After a participant's round poll: it may leave."""
