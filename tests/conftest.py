"""Shared fixtures: the test models, fetched by the project's own ``pull`` (CI starts from a clean machine)."""

import os

import pytest

# Tests must never reach the Hugging Face hub; transformers reads local GGUF files only.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct Q4_1 (llama architecture, 98 MB) in the tileinfer cache."""
    from tileinfer.pull import pull

    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_gguf():
    """Path of Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, 491 MB) in the tileinfer cache."""
    from tileinfer.pull import pull

    return pull("qwen2.5-coder-0.5b")
