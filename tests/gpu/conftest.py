"""GPU tests: skipped cleanly without CUDA or FlashInfer."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    try:
        import flashinfer  # noqa: F401
        reason = None if torch.cuda.is_available() else "CUDA is not available"
    except ImportError:
        reason = "flashinfer is not installed"
    if reason:
        for item in items:
            if "tests/gpu/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))
