"""HTTP clients that connect from a chosen loopback address (127.0.0.2, 127.0.0.3, ...): several "hosts" on one
machine, so that callers told apart by their address can be tested without a network."""

from __future__ import annotations

from typing import Any

import requests
from requests.adapters import HTTPAdapter


class _From(HTTPAdapter):
    def __init__(self, address: str) -> None:
        self.address = address
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = (self.address, 0)
        super().init_poolmanager(*args, **kwargs)


def session_from(address: str) -> requests.Session:
    """A session whose connections leave from ``address`` (any of 127.0.0.0/8 on Linux)."""
    session = requests.Session()
    session.trust_env = False
    session.mount("http://", _From(address))
    return session
