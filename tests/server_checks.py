"""What the tests that start a real `nanojax serve` process share."""
import time
import urllib.request

import pytest


def wait_until_healthy(port: int, timeout: float) -> None:
    """Polls /health until the server answers (any status), or fails the test."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:  # refused, or an HTTP error status: answering counts below
            time.sleep(0.3)
    pytest.fail("server did not start")
