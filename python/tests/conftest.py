"""Shared fixtures: every correctness test runs on the CPU backend and on
wgpu (lavapipe on a machine without a GPU: required, never skipped)."""

import os

import pytest
import torch

BACKENDS = [b for b in os.environ.get("FLASHATTN_TEST_BACKENDS", "cpu,wgpu").split(",") if b]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_report_header(config):
    import flashattn

    lines = [f"flashattn {flashattn.__version__}, backends under test: {', '.join(BACKENDS)}"]
    for b in BACKENDS:
        lines.append(f"  {b}: {flashattn.backend_info(b)['name']}")
    return lines
