"""What a start says about the C++ CPU ops: a first start, with a fresh build folder, says before compiling
what it builds, where, and that it happens once, and after it how long it took; a later start only says
which build it loaded. The compiler's part, a minute or more on a few cores, is cpp_extension.load: here a
stand-in hands over this machine's real build, and everything around it is the code a worker runs."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from torch.utils import cpp_extension

from pagedserve.kernels import cpu_backend
from pagedserve.kernels.cpu_backend import cpu_ops

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
LOGGER = "pagedserve.kernels.cpu_backend"


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    built = cpu_ops()
    assert built is not None, "a compiler is here, so the C++ ops must build"
    return built


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Path:
    """An empty cache folder, as on a newcomer's machine; its kernels folder."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_CPU_KERNELS", raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    return tmp_path / "cpu-kernels"


def start() -> ModuleType | None:
    """A worker's start: cpu_ops without the cache that keeps one process from loading twice."""
    return cpu_ops.__wrapped__()


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def hand_over(
    ops: ModuleType, said: list[str] | None = None, caplog: pytest.LogCaptureFixture | None = None
) -> Any:
    """cpp_extension.load's stand-in: this machine's build, where ninja would have linked it; said gets what
    the start had logged by the time it compiled."""

    def load(name: str, sources: list[str], build_directory: str, **_: Any) -> ModuleType:
        if said is not None:
            assert caplog is not None
            said.extend(messages(caplog))
        shutil.copyfile(ops.__file__, Path(build_directory) / f"{name}.so")
        return ops

    return load


def test_a_first_build_says_what_where_and_once_before_it_compiles_and_how_long_after(
    ops: ModuleType, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    said_before: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", hand_over(ops, said_before, caplog))

    assert start() is ops

    (building,) = said_before
    name = cpu_backend.build_name("native")
    for part in ("building the C++ CPU kernels for this CPU", str(fresh_cache / name), "a minute or more",
                 "once; later starts load it"):  # fmt: skip
        assert part in building
    assert len(messages(caplog)) == 2
    assert messages(caplog)[1].startswith("built the C++ CPU kernels in ")
    assert (fresh_cache / f"{name}.so").is_file(), "the finished build is not published for later starts"


def test_a_later_start_loads_the_build_and_compiles_nothing(
    ops: ModuleType, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpp_extension, "load", hand_over(ops))
    start()  # the first
    caplog.clear()

    def compile_(*_: Any, **__: Any) -> ModuleType:
        raise AssertionError("a later start compiled")

    monkeypatch.setattr(cpp_extension, "load", compile_)

    loaded = start()

    assert loaded is not None and hasattr(loaded, "rms_norm")
    (said,) = messages(caplog)
    assert said.startswith("C++ CPU kernels: loaded ") and str(fresh_cache) in said


def test_a_build_lock_left_by_a_killed_process_holds_up_no_later_start(
    ops: ModuleType, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build killed mid-way leaves cpp_extension's `lock` file in its folder, and no library published;
    cpp_extension waits forever on that file, so the next start must find it gone by the time it compiles."""
    work = fresh_cache / cpu_backend.build_name("native")
    work.mkdir(parents=True)
    (work / "lock").touch()
    compiled = hand_over(ops)

    def compile_(*args: Any, **kwargs: Any) -> ModuleType:
        assert not (work / "lock").exists(), "cpp_extension would wait on the killed build's lock"
        return compiled(*args, **kwargs)

    monkeypatch.setattr(cpp_extension, "load", compile_)

    assert start() is ops


def test_with_no_compiler_no_build_is_announced(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(fresh_cache / "no-compiler"))

    assert start() is None
    assert messages(caplog) == []  # only the warning (tests/kernels/test_cpu_backend.py)


@pytest.mark.parametrize(
    ("flags", "levels"),
    [
        ("flags : fpu sse2", []),
        ("flags : cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave",
         ["x86-64-v3"]),
        ("flags : cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave "
         "avx512f avx512bw avx512cd avx512dq avx512vl", ["x86-64-v4", "x86-64-v3"]),
        ("flags : cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm xsave", []),
    ],
    ids=["old", "avx2", "avx512", "no-movbe"],
)  # fmt: skip
def test_an_image_build_is_loaded_only_on_a_cpu_that_runs_its_level(
    monkeypatch: pytest.MonkeyPatch, flags: str, levels: list[str]
) -> None:
    """A library for a level the CPU lacks would die of an illegal instruction, not fail to load."""
    monkeypatch.setattr(cpu_backend, "_cpu_flags", lambda: flags)

    assert cpu_backend.runnable_levels() == levels


def test_every_source_compiles_at_the_lowest_level_an_image_ships() -> None:
    """An image builds each of LEVELS, and a function given a wider target than the build's (vdpbf16ps, where
    the CPU has it) must say so down to its lambdas: GCC's -march=native build here takes any such code, so
    without this test only the image build (scripts/compose_check.sh) would find the mismatch. -O0 is enough:
    an always_inline intrinsic inlined into code without its target fails at any level of optimisation."""
    lowest = next(iter(cpu_backend.LEVELS))
    includes = [f"-isystem{path}" for path in [*cpp_extension.include_paths(), sysconfig.get_path("include")]]
    flags = [*includes, "-std=c++20", *cpu_backend.cflags(lowest), "-O0"]
    compiles = {
        source.name: subprocess.Popen(
            ["c++", *flags, "-c", str(source), "-o", "/dev/null"], stderr=subprocess.PIPE, text=True
        )
        for source in cpu_backend.SOURCES  # all: a target may come from a header's macro (DOT_BF16_TARGET)
    }
    errors = {name: compile_.communicate()[1] for name, compile_ in compiles.items()}
    failed = {name: errors[name] for name, compile_ in compiles.items() if compile_.returncode != 0}
    assert not failed, failed
