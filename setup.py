"""Build hook for the optional native ring (native/, issue 8).

All project metadata stays in pyproject.toml; this file only declares the C
extension, so ``pip install .`` / ``pip install -e .`` compile it with the
ordinary setuptools build backend. ``optional=True`` makes a failed compile
(no gcc, no Python headers, not Linux) a warning: the package installs
anyway and ``transfer._ring`` falls back to its pure-Python implementation.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transfer._ring_native",
            sources=["native/_ring_native.c"],
            depends=["native/ring.h", "native/dataplane.h", "native/submission.h"],
            include_dirs=["native"],
            extra_compile_args=["-std=gnu11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ],
)
