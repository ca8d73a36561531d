"""Session-wide test set-up, in one place.

* ``tests/`` on ``sys.path`` for the shared ``helpers``.
* Without a GPU, the Triton kernels are tested under the interpreter: the variable is
  set here, before any test module imports Triton (``triton.jit`` reads it when a
  kernel is decorated), so it holds for the whole session whatever the test order.
  With a GPU it stays unset (compiled kernels) and the interpreter tests run in a
  child process (``tests/test_kernels_interpreter.py``).
* On a GPU under pytest-xdist, the tests marked ``helpers.LARGE_WEIGHTS`` (a model's
  full-size weights on the GPU, 11 GiB for deepseek_v3) run in one worker: the default
  scheduling (``load``) becomes ``loadgroup``, under which xdist sends each
  ``xdist_group`` to one worker.  Eight workers each holding such weights ran an 80 GB
  card out of memory.
* Every test starts from the same global RNG state, so no test depends on the tests
  before it; the builders in ``helpers`` take their own seeded generators anyway.
  Hypothesis draws its examples from a fixed seed too (``derandomize``): a run is
  reproducible, never flaky.
"""

import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("fp8_moe_ops", derandomize=True, database=None)
settings.load_profile("fp8_moe_ops")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's ``-n auto``) the workers share the cores: one worker's
# torch ops spread over all of them would oversubscribe them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_configure(config):
    if torch.cuda.is_available():
        if getattr(config.option, "dist", "no") == "load":  # the xdist controller: group-aware scheduling
            config.option.dist = "loadgroup"
        if hasattr(config, "workerinput"):  # an xdist worker: name each test's group in its id, as loadgroup does
            config.option.loadgroup = True


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
