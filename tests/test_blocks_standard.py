"""Prefect's standard block test suite for every block of ``tinker_blocks`` (offline parts), plus the
entry-point discovery that lets ``prefect block register`` and workers find them.

The suite checks a description, a documentation URL, a description ending with a period on every
field and a code example with an import and a ``.load("BLOCK_NAME")`` line. Its logo test downloads
the logo over the network, so it is skipped here (the blocks have no logo yet). The documentation
links are checked against ``pyproject.toml``, the pages under ``docs/`` and the ``mkdocs.yml`` navigation.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from tinker_blocks import CaptureStore, EvalStore, S3Credentials, TinkerCredentials, TrainingStore

BLOCKS = [TinkerCredentials, S3Credentials, TrainingStore, EvalStore, CaptureStore]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.__name__)
class TestTinkerBlocks(BlockStandardTestSuite):
    """Runs every test of :class:`BlockStandardTestSuite` once per block class."""

    @pytest.fixture
    def block(self, block):  # the parametrized class is the fixture value
        return block

    def test_has_a_valid_image(self, block) -> None:  # needs the network: not run offline
        pytest.skip("the logo check downloads the image (offline test suite)")


def test_entry_point_names_the_blocks_module():
    eps = [ep for ep in entry_points(group="prefect.collections") if ep.name == "prefect_tinker"]
    assert eps and eps[0].value == "tinker_blocks", "pyproject declares prefect.collections -> tinker_blocks"
    module = eps[0].load()
    assert {b.__name__ for b in BLOCKS} <= set(dir(module))


def test_block_types_found_by_prefect_collection_loading():
    """Prefect's own collection loader (used by workers, the server and ``Block.load`` by slug)
    imports the entry point and registers our block types."""
    from prefect.blocks.core import Block
    from prefect.plugins import load_prefect_collections

    loaded = load_prefect_collections()
    assert "prefect_tinker" in loaded
    from prefect.utilities.dispatch import lookup_type

    for slug in ("tinker-credentials", "tinker-s3-credentials", "tinker-training-store",
                 "tinker-eval-store", "tinker-capture-store"):
        assert lookup_type(Block, slug).get_block_type_slug() == slug


def test_secrets_are_masked_in_dumps_and_repr():
    creds = TinkerCredentials(api_key="tml-top-secret", base_url="http://gpu-box:8000")
    s3 = S3Credentials(aws_access_key_id="AKIAEXAMPLE", aws_secret_access_key="s3-top-secret")
    for block, secret in ((creds, "tml-top-secret"), (s3, "s3-top-secret")):
        assert secret not in repr(block) and secret not in str(block.model_dump())
        assert secret not in block.model_dump_json()
        schema = block.model_json_schema()
        field = "api_key" if block is creds else "aws_secret_access_key"
        assert schema["properties"][field]["anyOf"][0].get("format") == "password"


def test_documentation_urls_are_pages_of_the_documentation_site():
    root = Path(__file__).resolve().parents[1]
    homepage = tomllib.loads((root / "pyproject.toml").read_text())["project"]["urls"]["Homepage"]
    nav = (root / "mkdocs.yml").read_text()
    prefix = f"{homepage}/blob/main/docs/"
    for block in BLOCKS:
        url = block._documentation_url
        assert url.startswith(prefix) and url.endswith(".md"), (block.__name__, url)
        page = url.removeprefix(prefix)
        assert (root / "docs" / page).is_file() and f": {page}" in nav, (block.__name__, url)
