"""pytest plugin for scripts/suite_shards.sh: xdist worker gwN runs on CPUs 2N and 2N + 1 of the ones
it may use (wrapping around), as if each worker were a 2-vCPU CI machine; the engine's pool and torch
size themselves from that affinity when they start, after this runs."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    n = int(worker[2:])
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[(2 * n) % len(cpus)], cpus[(2 * n + 1) % len(cpus)]})
