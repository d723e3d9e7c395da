"""Shared pytest setup: GPU tests run only where CUDA is present; Model Runner V2 tests only with a vLLM release the
plugin supports on CUDA (``patches/versions.py``: V2's internals differ between releases, and only those of a
supported release are the plugin's contract)."""

import pytest
import torch


def _v2_supported() -> bool:
    import vllm

    from vllm_ddtree.patches import versions

    return versions.supported_release(vllm.__version__, "cuda") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("v2" in item.keywords for item in items) and not _v2_supported():
        skip_v2 = pytest.mark.skip(reason="Model Runner V2 code: the installed vLLM is not supported on CUDA")
        for item in items:
            if "v2" in item.keywords:
                item.add_marker(skip_v2)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
