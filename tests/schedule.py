"""A pytest plugin (pyproject.toml's addopts load it, and turn pytest-xdist's own reordering off): the test
files that take longest go to the test processes first. Under `--dist loadfile`, pytest-xdist hands out whole
files, and by default puts the files with the most tests first; that left the long files of one or two tests
for the end, where test_soak's three minutes ran while the other process had nothing left to do. Longest
first, then the many short files to even the two processes out, the suite's run ends on both at once."""

from __future__ import annotations

import pytest

# Each over a minute of the suite's run (its tests' times in `pytest -n 2 --dist loadfile --junitxml` on two
# cores), longest first; every other file follows in the order collected.
LONGEST = (
    "tests/integration/test_failover.py",  # 217 s
    "tests/integration/test_soak.py",  # 199 s
    "tests/kernels/test_cuda_kernels.py",  # 183 s
    "tests/unit/test_engine.py",  # 167 s
    "tests/integration/test_kv_tiers.py",  # 166 s
    "tests/integration/test_launcher.py",  # 142 s
    "tests/kernels/test_compile.py",  # 119 s
    "tests/integration/test_worker.py",  # 114 s
    "tests/integration/test_bench.py",  # 104 s
    "tests/integration/test_precisions.py",  # 84 s
    "tests/integration/test_gateway.py",  # 76 s
    "tests/integration/test_draft_model_stack.py",  # 69 s
    "tests/integration/test_faults.py",  # 62 s
    "tests/integration/test_pins.py",  # 61 s
    "tests/integration/test_family_failover.py",  # 61 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gone = [path for path in LONGEST if not (config.rootpath / path).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/schedule.py's LONGEST names test files that are not there: {gone}")
    rank = {path: place for place, path in enumerate(LONGEST)}
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST)))
