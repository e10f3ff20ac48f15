"""The plugin that hands out the longest test files first (tests/schedule.py), on an inner pytest session: the
files it names come first, longest first, each whole; the rest follow in the order collected; a name it keeps
for a file that is gone fails the session."""

from __future__ import annotations

import pytest

from tests import schedule

pytest_plugins = ["pytester"]


def test_the_longest_files_come_first_whole_and_the_rest_in_order(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(**{f"test_{name}": "def test_one(): pass\ndef test_two(): pass\n" for name in "abcd"})
    monkeypatch.setattr(schedule, "LONGEST", ("test_c.py", "test_b.py"))
    result = pytester.runpytest("-p", "tests.schedule", "--collect-only", "-q")
    collected = [line for line in result.outlines if "::" in line]
    files = ["test_c.py", "test_b.py", "test_a.py", "test_d.py"]
    assert collected == [f"{file}::test_{test}" for file in files for test in ("one", "two")]


def test_a_listed_file_that_is_gone_fails_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_a="def test_one(): pass\n")
    monkeypatch.setattr(schedule, "LONGEST", ("test_a.py", "tests/renamed.py"))
    result = pytester.runpytest("-p", "tests.schedule")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "LONGEST names test files that are not there: ['tests/renamed.py']" in result.stderr.str()


def test_every_file_it_names_is_a_test_file_of_this_repository(pytestconfig: pytest.Config) -> None:
    for path in schedule.LONGEST:
        assert (pytestconfig.rootpath / path).is_file(), path
        assert path.startswith("tests/") and path.rsplit("/", 1)[-1].startswith("test_"), path
    assert len(set(schedule.LONGEST)) == len(schedule.LONGEST)
