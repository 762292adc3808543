"""S3 credentials of the stores: from an ``S3Credentials`` block (no AWS environment), from the AWS
environment variables, converted from prefect-aws blocks, and wrong ones failing fast with one clear
line that never shows the secret (on a real SeaweedFS server where one is needed)."""

from __future__ import annotations

import time

import pytest

from prefect_tinker.cli import main as cli
from tinker_blocks import S3Credentials, StoreAccessError, TrainingStore


def test_credentials_block_without_env(s3_server, s3_root, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)
    creds = S3Credentials(aws_access_key_id=s3_server.access_key,
                          aws_secret_access_key=s3_server.secret_key,
                          endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    store = TrainingStore(root=s3_root, credentials=creds)
    store.check()
    store.record_run("r2", status="running")
    assert store.get_run("r2")["status"] == "running"
    assert s3_server.secret_key not in repr(store) and "**********" in repr(store)


def test_wrong_credentials_fail_fast_and_clearly(s3_server, s3_root, monkeypatch, capsys):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = TrainingStore(root=s3_root)
    t0 = time.monotonic()
    with pytest.raises(StoreAccessError) as err:
        store.check()
    msg = str(err.value)
    assert s3_root in msg and s3_server.endpoint_url in msg and "credentials" in msg
    assert "not-the-secret" not in msg
    with pytest.raises(StoreAccessError):
        store.record_run("r1", status="running")
    with pytest.raises(StoreAccessError):
        store.last_checkpoint("r1")
    assert time.monotonic() - t0 < 10  # no retry loop on a refusal
    assert cli.main(["sql", "--store", s3_root, "SELECT count(*) FROM metrics"]) == 1
    assert "access denied" in capsys.readouterr().err


def test_storage_options_from_environment():
    from tinker_blocks.s3 import s3_storage_options

    env = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_ENDPOINT_URL": "http://h:1",
           "AWS_DEFAULT_REGION": "eu-west-1", "AWS_SESSION_TOKEN": "T"}
    o = s3_storage_options(env=env)
    assert (o["key"], o["secret"], o["token"], o["endpoint_url"]) == ("AK", "SK", "T", "http://h:1")
    assert o["client_kwargs"] == {"region_name": "eu-west-1"}
    assert o["config_kwargs"]["s3"] == {"addressing_style": "path"}
    o = s3_storage_options(key="K2", secret="S2", env=env)  # explicit values win
    assert (o["key"], o["secret"], o["endpoint_url"]) == ("K2", "S2", "http://h:1")
    o = s3_storage_options(env={"AWS_ENDPOINT_URL_S3": "http://s3only:2", "AWS_ENDPOINT_URL": "http://x"})
    assert o["endpoint_url"] == "http://s3only:2" and "key" not in o  # botocore's chain decides


def test_s3_credentials_from_prefect_aws_blocks():
    """prefect-aws blocks convert without prefect-aws installed (duck-typed)."""
    from types import SimpleNamespace

    from pydantic import SecretStr

    params = SimpleNamespace(endpoint_url="http://127.0.0.1:9000")
    minio = SimpleNamespace(minio_root_user="admin", minio_root_password=SecretStr("pw"),
                            region_name="us-east-1", aws_client_parameters=params)
    c = S3Credentials.from_prefect_aws(minio)
    o = c.storage_options()
    assert (o["key"], o["secret"], o["endpoint_url"]) == ("admin", "pw", "http://127.0.0.1:9000")
    aws = SimpleNamespace(aws_access_key_id="AK", aws_secret_access_key=SecretStr("SK"),
                          aws_session_token=None, profile_name=None, assume_role_arn=None,
                          region_name="eu-west-1", aws_client_parameters=SimpleNamespace(endpoint_url=None))
    c = S3Credentials.from_prefect_aws(aws)
    assert c.aws_access_key_id == "AK" and c.aws_secret_access_key.get_secret_value() == "SK"
    assert c.region_name == "eu-west-1" and c.endpoint_url is None
    with pytest.raises(TypeError, match="AwsCredentials or MinIOCredentials"):
        S3Credentials.from_prefect_aws(object())
