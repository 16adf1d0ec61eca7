"""Fixtures for shadow tests; puts this directory on sys.path for ``shadow_testkit``."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

@pytest.fixture(autouse=True)
def _no_shadow_key_from_the_environment(monkeypatch):
    """A developer's CONTEXTKIT_SHADOW_KEY must not change what the tests see."""
    monkeypatch.delenv("CONTEXTKIT_SHADOW_KEY", raising=False)


@pytest.fixture
def store_url(tmp_path) -> str:
    return f"file://{tmp_path / 'shadow'}"


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint over HTTP: moto's threaded server on 127.0.0.1."""
    # boto3 and moto's server are installed by `make setup` (shadow and dev extras); a
    # missing one must fail these tests, not skip them.
    import boto3
    import moto.server as moto_server
    from shadow_testkit import BUCKET

    mp = pytest.MonkeyPatch()
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        mp.setenv(var, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()
    mp.undo()


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS credentials anywhere boto3 looks (env, files, instance metadata)."""
    import boto3

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it caches the fixture's credentials


@pytest.fixture(params=["file", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A shared-tier URL on a file store, then on moto's S3 (a prefix per test); the
    S3 case leaves its endpoint on ``request.node.endpoint``."""
    from shadow_testkit import BUCKET

    if request.param == "file":
        return f"file://{tmp_path / 'shared'}"
    endpoint = request.getfixturevalue("s3_endpoint")
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    request.node.endpoint = endpoint
    return f"s3://{BUCKET}/{prefix}"
