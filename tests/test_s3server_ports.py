"""The test S3 server (tests/support/s3server.py) survives a port taken between picking it and binding it (CI's phase 1
lost a whole worker's object-store tests to one: "weed exited with 255", 32 skips)."""

from __future__ import annotations

import socket

import pytest
from s3server import S3Server, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="needs s3/server: no weed binary")


def test_a_port_taken_before_the_first_start_is_picked_again() -> None:
    server = S3Server()
    taken = server.filer_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen(1)
        try:
            server.start()
            assert server.filer_port != taken
            assert server.answers()
        finally:
            server.close()
