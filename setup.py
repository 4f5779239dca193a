"""Build the Cython kernels in ext/ into hpcps.kernels.

Options (environment variables, read at build time):

HPCPS_MARCH_NATIVE=1   add -march=native. Only right when the machine that builds is the
                       machine that runs (login nodes and compute nodes often differ), so it
                       is off by default.
HPCPS_NO_OPENMP=1      build without OpenMP (for compilers that lack it).
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

# -fno-math-errno lets GCC vectorize sqrtf (otherwise it keeps a scalar call that may set
# errno): measured 2x on the Adagrad kernel. Nothing in the kernels reads errno.
compile_args = ["-O3", "-fno-math-errno"]
link_args = []
if os.environ.get("HPCPS_NO_OPENMP") != "1":
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")
if os.environ.get("HPCPS_MARCH_NATIVE") == "1":
    compile_args.append("-march=native")


def kernel(name: str) -> Extension:
    """hpcps.kernels._<name> from ext/<name>.pyx, with the flags above."""
    return Extension(
        f"hpcps.kernels._{name}",
        [f"ext/{name}.pyx"],
        include_dirs=[np.get_include(), "ext"],
        depends=({"hogwild": ["ext/zero_skip.h", "ext/zero_skip.pxd", "ext/sgemm_ptr.pxi",
                              "ext/layers.pxi"],
                  "gemm": ["ext/zero_skip.h", "ext/zero_skip.pxd", "ext/sgemm_ptr.pxi"],
                  "convnet": ["ext/sgemm_ptr.pxi", "ext/layers.pxi"]}.get(name, [])),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


# adagrad: the server's update; compress: Strom's threshold/apply/Golomb-Rice; hogwild: the
# nogil multi-threaded MLP engine; convnet: the same for conv networks; gemm: fused GEMM
# kernels (the last three call BLAS through scipy.linalg.cython_blas, so scipy is a build
# requirement); embedding: sparse embedding tables (unique, gather, segment sum, row updates,
# the shard's row store)
extensions = [kernel(name) for name in ("adagrad", "compress", "hogwild", "convnet", "gemm",
                                        "embedding")]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
