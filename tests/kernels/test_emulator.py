"""How the emulated kernels are built: emulate.h's standard includes, precompiled once for each set of
flags (with the race checker's and without), are what the compiler takes, not their text."""

from __future__ import annotations

import subprocess

import pytest

from pagedserve.kernels import emulator
from pagedserve.kernels.nvrtc import CSRC

pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="needs a C++ compiler")


@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "racecheck"])
def test_the_standard_headers_are_taken_precompiled(checked: bool) -> None:
    cxx = emulator.compiler()
    assert cxx is not None
    flags = [*emulator.CXXFLAGS, *(emulator.RACECHECK_FLAGS if checked else [])]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    header = emulator._standard_headers(cxx, (CSRC / "emulate.h").read_text(), flags, version)
    assert "#include <vector>" in header.read_text()
    # -H lists each header the compiler reads; a precompiled one it takes is marked "!".
    done = subprocess.run(
        [cxx, *flags, "-include", str(header), "-DHEAD_DIM=64", "-H", "-fsyntax-only", "-x", "c++", "-"],
        input="int main() { return 0; }\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"! {header}.gch" in done.stderr.splitlines(), done.stderr[:2000]
