import os
import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A free TCP port on localhost for a test's own process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# tests/gpu needs CUDA: `make gpu-check` runs it (HARDVIEW_GPU_TESTS=1); `make test` leaves it out.
collect_ignore_glob = [] if os.environ.get("HARDVIEW_GPU_TESTS") else ["gpu/*"]
