"""A real S3-protocol server for the remote-cache tests: moto's server mode on a free port.

``s3_endpoint`` starts ``moto.server.ThreadedMotoServer`` on a port the OS picks, waits until
it answers HTTP (polling the endpoint, never a fixed sleep), and points every S3 client of
this process and its children at it through the environment (``AWS_ENDPOINT_URL`` and dummy
keys), so ``s3://`` URLs go through s3fs and botocore exactly as against AWS. ``bucket``
gives each test a fresh bucket. Without moto or s3fs the tests are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_READY_WITHIN = 30.0  # seconds: a bound for a loaded machine, not a synchronisation


def _wait_until_answering(endpoint: str) -> None:
    """Poll ``endpoint`` until the server answers any HTTP status."""
    deadline = time.monotonic() + _READY_WITHIN
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answered, with an error status: it is up
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.01)  # a poll interval: readiness is the answer above, not this pause


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError as error:
        pytest.skip(f"the S3 tests need moto[server] and s3fs, which did not import: {error}")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        _wait_until_answering(endpoint)
        with pytest.MonkeyPatch.context() as patch:
            for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
                patch.delenv(name, raising=False)
            for name, value in {**_ENVIRONMENT, "AWS_ENDPOINT_URL": endpoint}.items():
                patch.setenv(name, value)
            s3fs.S3FileSystem.clear_instance_cache()
            yield endpoint
    finally:
        server.stop()
        with contextlib.suppress(Exception):
            s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(s3_endpoint: str):
    """An s3fs filesystem on the test server (a fresh instance)."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.fixture
def bucket(s3) -> str:
    """A new, empty bucket's name."""
    name = f"graphsplit-{secrets.token_hex(6)}"
    s3.mkdir(name)
    return name


def remote_names(s3, prefix: str) -> list[str]:
    """Every object under ``prefix``, relative to it (hidden ones included)."""
    return sorted(
        path.removeprefix(prefix.rstrip("/") + "/") for path in s3.find(prefix, refresh=True)
    )


def worker_env() -> dict[str, str]:
    """This process's environment (the server's endpoint and keys included) for a worker."""
    return dict(os.environ)
