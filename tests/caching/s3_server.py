"""A real S3-protocol server for the remote-cache tests: moto's server mode on a free port.

:class:`LocalS3` starts ``moto.server.ThreadedMotoServer`` on a port the OS picks, waits until
it answers HTTP (polling the endpoint, never a fixed sleep), and points every S3 client of
this process and its children at it through the environment (``AWS_ENDPOINT_URL`` and dummy
keys), so ``s3://`` URLs go through s3fs and botocore exactly as against AWS; ``stop()``
restores the environment. The ``s3_endpoint`` fixture runs one for the session, ``bucket``
gives each test a fresh bucket, and the docs' snippets use one too (docs/howto.md). Without
moto or s3fs the fixtures skip with the reason.
"""

from __future__ import annotations

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
_CLEARED = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
_READY_WITHIN = 30.0  # seconds: a bound for a loaded machine, not a synchronisation


class LocalS3:
    """A moto S3 server on a free port, with this process's environment pointed at it."""

    def __init__(self, *buckets: str) -> None:
        import s3fs
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._saved = {name: os.environ.get(name) for name in (*_ENVIRONMENT, *_CLEARED)}
        self._saved["AWS_ENDPOINT_URL"] = os.environ.get("AWS_ENDPOINT_URL")
        try:
            _wait_until_answering(self.endpoint)
            for name in _CLEARED:
                os.environ.pop(name, None)
            os.environ.update({**_ENVIRONMENT, "AWS_ENDPOINT_URL": self.endpoint})
            s3fs.S3FileSystem.clear_instance_cache()
            self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
            for name in buckets:
                # moto keeps one store per process, shared by every server it starts: a bucket
                # an earlier test made is emptied, so each LocalS3 starts from empty buckets.
                if self.fs.exists(name):
                    self.fs.rm(name, recursive=True)
                    self.fs.invalidate_cache()
                self.fs.mkdir(name)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server and restore the environment."""
        import s3fs

        self._server.stop()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()


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
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as error:
        pytest.skip(f"the S3 tests need moto[server] and s3fs, which did not import: {error}")
    server = LocalS3()
    try:
        yield server.endpoint
    finally:
        server.stop()


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
