"""Fixtures of the CLI and batch tests."""

import pytest


@pytest.fixture
def model(tiny_dir):
    """A 4-layer tiny llama's folder, as ``-m`` takes it."""
    return str(tiny_dir("llama", num_hidden_layers=4))
