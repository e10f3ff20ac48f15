"""The CI plugin that fails a run in which a test skips unseen (tests/strict_skips.py), run on an inner
pytest session: a plain skip fails it, naming the test and its reason; a `gpu` test's skip does not."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

@pytest.mark.gpu
@pytest.mark.skip(reason="no CUDA device")
def test_on_a_gpu(): pass

def test_runs(): pass
"""


@pytest.mark.parametrize("strict", [True, False])
def test_a_skip_outside_the_allow_list_fails_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, strict: bool
) -> None:
    pytester.makeini("[pytest]\nmarkers = gpu: needs a CUDA device\n")
    pytester.makepyfile(
        test_allowed=TESTS,
        test_refused="import pytest\n\ndef test_attack():\n    pytest.skip('needs root')\n",
    )
    if strict:
        monkeypatch.setenv("PAGEDSERVE_STRICT_SKIPS", "1")
    else:
        monkeypatch.delenv("PAGEDSERVE_STRICT_SKIPS", raising=False)
    result = pytester.runpytest("-p", "tests.strict_skips", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if strict else pytest.ExitCode.OK)
    summary = "test_refused.py::test_attack: Skipped: needs root"
    assert (summary in result.stdout.str()) is strict
    assert "test_on_a_gpu: " not in result.stdout.str().split("must run here")[-1]


def test_only_allowed_skips_pass(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nmarkers = gpu: needs a CUDA device\n")
    pytester.makepyfile(test_allowed=TESTS)
    monkeypatch.setenv("PAGEDSERVE_STRICT_SKIPS", "1")
    result = pytester.runpytest("-p", "tests.strict_skips")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK
