"""Shared fixtures: the test models, fetched by the project's own ``pull`` (CI starts from a clean machine).

The op tests' own fixtures (the backends under test, poisoned outputs, fresh seeds) are in tests/ops/conftest.py.
"""

import os

import pytest
import torch

# Tests must never reach the Hugging Face hub; transformers reads local GGUF files only.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Without a GPU the Triton kernels run in Triton's interpreter; the flag must be set before any
# module defines them, so it is set here, before collection imports the test modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct Q4_1 (llama architecture, 98 MB) in the tileinfer cache."""
    from tileinfer.core.fetch import pull

    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_gguf():
    """Path of Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, 491 MB) in the tileinfer cache."""
    from tileinfer.core.fetch import pull

    return pull("qwen2.5-coder-0.5b")
