"""Optional ahead-of-time build of the CPU extension as ``lomo_kernels._C_cpu``.

Metadata lives in pyproject.toml. By default nothing is compiled: the C++ backend JIT-builds
itself on first use (see lomo_kernels/kernels/cpp/extension.py). With LOMO_KERNELS_BUILD_EXT=1
the extension is built here; load it with LOMO_KERNELS_PREBUILT=1. This build targets the
baseline ISA of the compiler (portable wheels); the JIT build uses -march=native.
"""

import os
import sys

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("LOMO_KERNELS_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    if sys.platform == "win32":
        cflags, ldflags = ["/O2", "/openmp"], []
    else:
        # Same reasons as extension.cpu_build_flags(): exact rounding, vector selects, OpenMP.
        cflags = ["-O3", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
        ldflags = ["-fopenmp"]
    ext_modules.append(
        CppExtension(
            "lomo_kernels._C_cpu",
            ["csrc/lomo_cpu.cpp"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    )
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
