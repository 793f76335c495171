"""Kernel-test options: `--kernel-mode=interpret` (default, CPU) or `gpu`.

`gpu` runs the Pallas kernel compiled for the GPU (interpret=False); the
reference path then runs on the GPU as well.
"""

import pytest


def pytest_addoption(parser):
  parser.addoption(
      "--kernel-mode", choices=("interpret", "gpu"), default="interpret",
      help="run Pallas kernels in interpret mode (CPU) or compiled for GPU")


@pytest.fixture(scope="session")
def kernel_mode(request):
  mode = request.config.getoption("--kernel-mode", default="interpret")
  if mode == "gpu":
    import jax
    if jax.default_backend() != "gpu":  # a GPU check must not pass silently
      pytest.exit("--kernel-mode=gpu needs a GPU backend, found "
                  f"{jax.default_backend()!r}", returncode=1)
  return mode


@pytest.fixture(scope="session")
def interpret(kernel_mode):
  return kernel_mode == "interpret"
