"""Test-wide setup. Environment first: Triton reads TRITON_INTERPRET when a kernel is defined."""

import os
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MRV2_PLUGIN_AUTOLOAD", "1")
if not os.environ.get("MRV2_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # tensor-parallel workers forked from a pre-imported process (mrv2.executor.zygote): the
    # suite builds ~100 tensor-parallel engines, each worker ~6 s of imports otherwise
    os.environ.setdefault("MRV2_WORKER_ZYGOTE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mrv2_logging_left_as_found() -> Iterator[None]:
    """The ``mrv2`` command's logging (a test that runs ``cli.main`` in-process installs it)
    does not outlive the test: no stderr handler, no level on the ``mrv2`` logger after it."""
    yield
    import logging

    from mrv2.logs import _Handler

    root = logging.getLogger("mrv2")
    for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)
