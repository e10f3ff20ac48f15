"""A pytest plugin for CI: with $PAGEDSERVE_STRICT_SKIPS set, the session fails when a test skips that is
not allowed to, so that a test CI relies on (a local-attacker test, a root-only test, a C++ kernel's parity
case) can never skip unseen. Only the tests marked `gpu` may skip (where there is no CUDA device), and those
ALLOWED names with its reason: every other skip is listed with its reason, and the run's status becomes 1."""

from __future__ import annotations

import os

import pytest

ENV = "PAGEDSERVE_STRICT_SKIPS"
ALLOWED_MARKER = "gpu"
ALLOWED = {
    # PyPI's cuobjdump is CUDA 13's, which reads no cubin of NVRTC 12 (ELF ABI 7); nvcc's cubins are compared.
    "tests/kernels/test_resources.py::test_every_kernel_matches_cuobjdump[nvrtc]",
}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not os.environ.get(ENV) or reporter is None:
        return
    refused = [
        f"  {report.nodeid}: {_reason(report)}"
        for report in reporter.stats.get("skipped", [])
        if ALLOWED_MARKER not in report.keywords and report.nodeid not in ALLOWED
    ]
    if refused:
        heading = (
            f"${ENV}: {len(refused)} tests skipped that must run here (only `{ALLOWED_MARKER}` tests may):"
        )
        reporter.write_line("\n".join([heading, *refused]), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _reason(report: pytest.TestReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
