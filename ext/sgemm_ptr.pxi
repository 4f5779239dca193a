# The sgemm an extension's kernels call, switchable at run time (``include``d by
# ext/gemm.pyx and ext/hogwild.pyx; each module keeps its own pointer).
from scipy.linalg.cython_blas cimport sgemm as _scipy_sgemm

# sgemm's Fortran interface (column-major, every argument by pointer, 32-bit ints).
ctypedef void (*sgemm_fn)(char *transa, char *transb, int *m, int *n, int *k, float *alpha,
                          float *a, int *lda, float *b, int *ldb, float *beta, float *c,
                          int *ldc) noexcept nogil

# scipy's (OpenBLAS) unless hpcps.kernels.blas points it at another library's (MKL's)
cdef sgemm_fn _f_sgemm = _scipy_sgemm


def _set_sgemm(size_t address):
    """Make this module's kernels call the Fortran ``sgemm`` at ``address`` (LP64,
    single-threaded); 0 goes back to ``scipy.linalg.cython_blas.sgemm``. Used by
    ``hpcps.kernels.blas``; not while a kernel runs."""
    global _f_sgemm
    _f_sgemm = _scipy_sgemm if address == 0 else <sgemm_fn>address


def _get_sgemm():
    """Address of the sgemm this module's kernels call (``_set_sgemm``'s argument, or
    scipy's)."""
    return <size_t>_f_sgemm
