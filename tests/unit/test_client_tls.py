"""The participant's TLS trust (`participant/client/answers.tls_context`): the default trust is
made once per process and shared by every client; a CA file is read afresh each time."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from fedtrain.errors import TLSError
from fedtrain.participant.client.answers import tls_context
from tests.helpers.tls import make_tls


def test_the_default_trust_is_made_once_and_shared() -> None:
    first = tls_context(True)
    assert isinstance(first, ssl.SSLContext) and first.verify_mode == ssl.CERT_REQUIRED and first.check_hostname
    assert tls_context(True) is first
    assert tls_context(False) is False  # no verification: httpx's own setting


def test_a_ca_file_is_read_each_time(tmp_path: Path) -> None:
    ca = make_tls(tmp_path)[0]
    one, two = tls_context(str(ca)), tls_context(str(ca))
    assert isinstance(one, ssl.SSLContext) and one is not two  # a renewed CA file is read by the next client
    with pytest.raises(TLSError, match="as a CA certificate"):
        tls_context(str(tmp_path / "missing.pem"))
