"""The participant's calls of secure aggregation (`/v1/rounds/{r}/secagg/...`), over a
`CoordinatorClient` (its retry boundary, its participant keys). docs/privacy.md."""

from __future__ import annotations

from typing import Any

from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.client.retry import RetryPolicy


class SecAggCalls:
    """One participant's secure-aggregation requests for the rounds of a run."""

    def __init__(self, client: CoordinatorClient, pid: str, retry: RetryPolicy | None = None) -> None:
        self.client = client
        self.pid = pid
        self.retry = retry

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        # the client's own JSON boundary: retries, the participant key, one error shape
        answer: dict[str, Any] = self.client._json(method, path, headers=self.client._as(self.pid),
                                                   retry=self.retry, **kwargs)
        return answer

    def state(self, r: int, *, wait_s: float = 0.0, phase: str | None = None,
              session: str | None = None) -> dict[str, Any]:
        """The round's phase, session and setup, and our id (given in the keys phase); long-polled
        up to `wait_s` while it is `phase` of `session`."""
        params: dict[str, Any] = {"participant_id": self.pid, "wait": wait_s}
        if phase is not None:
            params["phase"] = phase
        if session is not None:
            params["session"] = session
        return self._call("GET", f"/v1/rounds/{r}/secagg", params=params)

    def advertise(self, r: int, session: str, keys: dict[str, str], tokens: int | None) -> dict[str, Any]:
        """Our public keys, with our token claim (None: claimed after training, `claim`)."""
        body: dict[str, Any] = {"session": session, **keys}
        if tokens is not None:
            body["tokens"] = tokens
        return self._call("POST", f"/v1/rounds/{r}/secagg/keys/{self.pid}", json=body)

    def claim(self, r: int, session: str, tokens: int) -> dict[str, Any]:
        return self._call("POST", f"/v1/rounds/{r}/secagg/claim/{self.pid}", json={"session": session,
                                                                                 "tokens": tokens})

    def directory(self, r: int, session: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/rounds/{r}/secagg/directory/{self.pid}", params={"session": session})

    def post_shares(self, r: int, session: str, sealed: dict[int, bytes]) -> dict[str, Any]:
        return self._call("POST", f"/v1/rounds/{r}/secagg/shares/{self.pid}",
                          json={"session": session, "shares": {str(k): v.hex() for k, v in sealed.items()}})

    def mailbox(self, r: int, session: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/rounds/{r}/secagg/mailbox/{self.pid}", params={"session": session})

    def unmask_request(self, r: int, session: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/rounds/{r}/secagg/unmask/{self.pid}", params={"session": session})

    def reveal(self, r: int, session: str, shares: list[dict[str, Any]]) -> dict[str, Any]:
        return self._call("POST", f"/v1/rounds/{r}/secagg/reveal/{self.pid}", json={"session": session,
                                                                                   "shares": shares})
