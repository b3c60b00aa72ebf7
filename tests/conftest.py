"""Shared fixtures for the tierkv test suite."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["s3_fixtures"]  # the local S3 server fixture (issue 4)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
