"""Optional ahead-of-time build of the C++/CUDA extensions as ``lomo_kernels._C_*``.

Metadata lives in pyproject.toml. By default nothing is compiled: the C++ backends JIT-build
themselves on first use (see lomo_kernels/kernels/cpp/extension.py). With
LOMO_KERNELS_BUILD_EXT=1 every extension is built here (the CPU ones always, the CUDA ones
with a CUDA build of torch); load them with LOMO_KERNELS_PREBUILT=1. This build targets the
baseline ISA of the compiler (portable wheels); on x86-64 the CPU kernels still pick their
AVX2 or AVX-512 loops at run time (csrc/cpu_isa.h), as the JIT build does.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("LOMO_KERNELS_BUILD_EXT") == "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # The extensions' names and sources, as the JIT loader builds them (read without
    # importing the package, which needs torch's extension machinery only on first use).
    spec = importlib.util.spec_from_file_location(
        "lomo_kernels_extension", Path("lomo_kernels/kernels/cpp/extension.py")
    )
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)

    if sys.platform == "win32":
        cflags, ldflags = ["/O2", "/openmp"], []
    else:
        # Same reasons as extension.cpu_build_flags(): exact rounding, vector selects, OpenMP.
        cflags = ["-O3", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
        ldflags = ["-fopenmp"]
    for name, sources in extension.EXTENSIONS.items():
        paths = [f"csrc/{source}" for source in sources]
        if name.endswith("_cuda"):
            if torch.version.cuda is None:
                continue  # a CPU build of torch: the CUDA extensions cannot link
            # No --use_fast_math: it would flush subnormals and change the fp32 rounding.
            ext_modules.append(
                CUDAExtension(
                    extension.prebuilt_name(name),
                    paths,
                    include_dirs=[str(Path("csrc").resolve())],
                    extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
                )
            )
        else:
            ext_modules.append(
                CppExtension(
                    extension.prebuilt_name(name),
                    paths,
                    include_dirs=[str(Path("csrc").resolve())],
                    extra_compile_args=cflags,
                    extra_link_args=ldflags,
                )
            )
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
