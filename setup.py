"""Builds localspec's C kernels (native/) into a plain shared library inside the package.

Everything else about the package is in pyproject.toml. The library has no Python API: it
is built as an extension-module file only so that setuptools compiles and installs it in
both `pip install .` and editable installs (`pip install -e .`); localspec.native loads it
with ctypes. A failed build (no C compiler) leaves localspec on its numpy reference paths
(`localspec.native.AVAILABLE` is False and says why).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("native")
SOURCES = sorted(str(p) for p in NATIVE.glob("*.c"))


class BuildNative(build_ext):
    """Compile native/*.c with -O3 (C11, no FP contraction, so results are the same on every
    machine) and OpenMP where the compiler has it."""

    def get_export_symbols(self, ext):  # no PyInit_ symbol: this is not a Python module
        return []

    def _compiles(self, flags: list[str], link: list[str]) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probe.c"
            src.write_text("#include <omp.h>\nint probe(void) { return omp_get_max_threads(); }\n")
            try:
                objs = self.compiler.compile([str(src)], output_dir=tmp, extra_postargs=flags)
                self.compiler.link_shared_object(objs, str(Path(tmp) / "probe.so"), extra_postargs=link)
                return True
            except Exception:
                return False

    def build_extension(self, ext):
        msvc = self.compiler.compiler_type == "msvc"
        if msvc:
            ext.extra_compile_args = ["/O2", "/std:c11", "/fp:precise"]
            omp = (["/openmp"], [])
        else:
            ext.extra_compile_args = [
                "-O3", "-std=c11", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno",
                "-fvisibility=hidden", "-Wall",
            ]  # fmt: skip
            omp = (["-fopenmp"], ["-fopenmp"])
            if sys.platform == "darwin":
                omp = (["-Xpreprocessor", "-fopenmp"], ["-lomp"])
        if os.environ.get("LOCALSPEC_NATIVE_OPENMP", "1") != "0" and self._compiles(*omp):
            ext.extra_compile_args += omp[0]
            ext.extra_link_args = list(omp[1])
        else:
            print("localspec: building the native kernels without OpenMP (single-threaded)")
        super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "localspec.native._lsnative",
            sources=SOURCES,
            include_dirs=[str(NATIVE)],
            depends=[str(p) for p in NATIVE.glob("*.h")],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
