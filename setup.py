"""Build hook for the package's native core, `transfer._native` (native/).

All project metadata stays in pyproject.toml; this file only declares the C
extension, so ``pip install .`` / ``pip install -e .`` compile it with the
ordinary setuptools build backend. The extension is the product (the ring,
the data plane, the client's submission): there is no pure-Python fallback,
so a build that cannot compile it fails, and says what is missing.
"""

import sys
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
    """build_ext whose failure names the fix: a C11 compiler and the Python headers."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing compiler (DistutilsPlatformError)
            sys.stderr.write(
                "\ntransfer: cannot build its native core (transfer._native) from native/*.c: "
                f"{type(exc).__name__}: {exc}\n"
                "It needs a C11 compiler (gcc or clang) and the Python development headers, on Linux:\n"
                "  Debian/Ubuntu: apt install gcc python3-dev    Fedora/RHEL: dnf install gcc python3-devel\n"
                "or install a prebuilt wheel (manylinux x86_64 and aarch64: see docs/operations.md, \"Building\").\n\n"
            )
            raise


setup(
    cmdclass={"build_ext": BuildNative},
    ext_modules=[
        Extension(
            "transfer._native",
            sources=sorted(glob("native/*.c")),
            depends=sorted(glob("native/*.h")),
            include_dirs=["native"],
            libraries=["dl"],  # dlopen of the CUDA driver (native/cuda.c); part of libc from glibc 2.34
            extra_compile_args=["-std=gnu11", "-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        )
    ],
)
