"""``S3Credentials``: a Prefect block with the key, secret and endpoint of an S3 (or S3-compatible)
object store, used by the store blocks for ``s3://`` roots.

Why our own block and not prefect-aws's ``AwsCredentials`` / ``MinIOCredentials``: prefect-aws
installs cleanly, but it would add boto3 + s3transfer to every install and ~1.5 s to imports for
five fields, and its assume-role settings have no s3fs equivalent. Existing prefect-aws blocks
convert with :meth:`S3Credentials.from_prefect_aws` (duck-typed: prefect-aws need not be
installed here).
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.abstract import CredentialsBlock
from pydantic import Field, SecretStr

from tinker_blocks.docs import docs_url
from tinker_blocks.s3 import s3_storage_options

__all__ = ["S3Credentials"]


class S3Credentials(CredentialsBlock):
    """Access key, secret and endpoint for S3 or an S3-compatible server (MinIO, SeaweedFS, R2...).

    Every field left empty falls back to the standard AWS environment variable
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
    ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), then to botocore's own chain (``~/.aws``,
    instance roles). The secret is a ``SecretStr``: never logged or shown.

    Example:
        ```python
        creds = S3Credentials(aws_access_key_id="AKIA...", aws_secret_access_key="...",
                              endpoint_url="http://127.0.0.1:8333")
        store = TrainingStore(root="s3://bucket/prefix", credentials=creds)
        ```
    """

    _block_type_name = "Tinker S3 Credentials"
    _block_type_slug = "tinker-s3-credentials"
    _description = "Key, secret and endpoint of an S3 or S3-compatible object store for the Tinker stores."
    _documentation_url = docs_url("stores")  # type: ignore[assignment]
    _code_example = """
```python
from tinker_blocks import S3Credentials, TrainingStore

s3 = S3Credentials.load("BLOCK_NAME")  # or S3Credentials(aws_access_key_id=..., endpoint_url=...)
store = TrainingStore(root="s3://bucket/prefix", credentials=s3)
```"""

    aws_access_key_id: str | None = Field(default=None, description="Access key id (AWS_ACCESS_KEY_ID when empty).")
    aws_secret_access_key: SecretStr | None = Field(
        default=None, description="Secret access key (AWS_SECRET_ACCESS_KEY when empty)."
    )
    aws_session_token: SecretStr | None = Field(
        default=None, description="Session token for temporary credentials (optional)."
    )
    endpoint_url: str | None = Field(
        default=None,
        description="Endpoint of an S3-compatible server, e.g. http://127.0.0.1:8333 (AWS_ENDPOINT_URL when empty).",
    )
    region_name: str | None = Field(default=None, description="Region (AWS_DEFAULT_REGION when empty).")

    def storage_options(self) -> dict[str, Any]:
        """``s3fs.S3FileSystem`` keyword arguments (see :func:`tinker_blocks.s3.s3_storage_options`)."""
        return s3_storage_options(
            key=self.aws_access_key_id,
            secret=self.aws_secret_access_key.get_secret_value() if self.aws_secret_access_key else None,
            token=self.aws_session_token.get_secret_value() if self.aws_session_token else None,
            endpoint_url=self.endpoint_url,
            region=self.region_name,
        )

    def get_client(self) -> Any:
        """An ``s3fs.S3FileSystem`` with these credentials (``CredentialsBlock`` interface)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    @classmethod
    def from_prefect_aws(cls, block: Any) -> S3Credentials:
        """Convert a prefect-aws ``AwsCredentials`` or ``MinIOCredentials`` block (duck-typed).

        ``AwsCredentials`` with ``profile_name`` or ``assume_role_arn`` is resolved once through
        its boto3 session (temporary credentials: convert again when they expire).

        Raises:
            TypeError: ``block`` has neither form's fields.
        """
        params = getattr(block, "aws_client_parameters", None)
        endpoint = getattr(params, "endpoint_url", None) if params is not None else None
        region = getattr(block, "region_name", None)
        if hasattr(block, "minio_root_user"):
            pw = block.minio_root_password
            return cls(
                aws_access_key_id=block.minio_root_user,
                aws_secret_access_key=pw.get_secret_value() if pw is not None else None,
                endpoint_url=endpoint,
                region_name=region,
            )
        if not hasattr(block, "aws_access_key_id"):
            raise TypeError(
                f"expected a prefect-aws AwsCredentials or MinIOCredentials block, got {type(block).__name__}"
            )
        if getattr(block, "profile_name", None) or getattr(block, "assume_role_arn", None):
            frozen = block.get_boto3_session().get_credentials().get_frozen_credentials()
            key, secret, token = frozen.access_key, frozen.secret_key, frozen.token
        else:
            key = block.aws_access_key_id
            secret = block.aws_secret_access_key.get_secret_value() if block.aws_secret_access_key else None
            token = getattr(block, "aws_session_token", None)
        return cls(
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            aws_session_token=token if token else None,
            endpoint_url=endpoint,
            region_name=region,
        )
