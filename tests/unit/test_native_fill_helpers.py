"""native/fill_helpers.h, the persistent helper threads that fill CUDA index staging: built
from C++ and run here (with ThreadSanitizer when the compiler has it), since the CUDA path
that uses them runs only on the GPU machine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"


def _compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    pytest.skip("no C++ compiler")


@pytest.mark.parametrize("sanitize", [True, False], ids=["tsan", "plain"])
def test_fill_helpers_lend_join_stop(tmp_path, sanitize):  # type: ignore[no-untyped-def]
    exe = tmp_path / "fill_helpers_test"
    flags = ["-fsanitize=thread", "-O1", "-g"] if sanitize else ["-O2"]
    build = subprocess.run([_compiler(), "-std=c++17", *flags, f"-I{NATIVE}", str(NATIVE / "tests" / "fill_helpers_test.cpp"),
                            "-o", str(exe), "-pthread"], capture_output=True, text=True, timeout=120)
    if build.returncode != 0:
        if sanitize:
            pytest.skip(f"no ThreadSanitizer here: {build.stderr[-300:]}")
        raise AssertionError(build.stderr)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "ok"
    assert "ThreadSanitizer" not in run.stderr, run.stderr
