"""Update kernels for the parameter-server shards: compiled, with a NumPy fallback.

The kernels are built from ``ext/*.pyx`` into ``hpcps.kernels._adagrad``
(``pip install -e .`` or ``python setup.py build_ext --inplace``). Where that module is
missing or does not load, the pure-NumPy versions in ``hpcps.kernels.reference`` are used
instead, with one warning at import: the results are the same, the updates slower.

Environment
-----------
HPCPS_NO_EXTENSION=1
    Use the NumPy reference even where the extension is built; read once, at import.
    Useful to test the fallback path, or to rule the compiled code out when chasing a bug.

The functions here check their input before handing it to either implementation, so both
refuse the same things with the same ``ValueError``: arrays must be 1-D, float32,
C-contiguous, of one length, writable where written, and must not overlap each other
(the compiled loop may be vectorized and split over threads, so overlapping operands
would make the result depend on the build).

Attributes
----------
HAVE_EXTENSION : bool
    True when the compiled kernels are the ones in use.
"""
import importlib
import math
import operator
import os
import sys
import warnings

import numpy as np

from . import reference

def _load_cython_blas_alone() -> None:
    """Load ``scipy.linalg.cython_blas`` without running ``scipy.linalg``'s ``__init__``.

    The compiled kernels cimport sgemm from that module, and Cython imports it by its dotted
    name, which imports the whole of ``scipy.linalg`` first (0.3-0.6 s of CPU, paid by every
    MPI rank at start; a 4-rank job on 2 cores waited over a second for it). Loaded from its
    file and put in ``sys.modules`` first, the module is found there and ``scipy.linalg``
    is left unloaded until someone imports it (it then picks the loaded module up). On any
    failure nothing is left behind and the usual import happens.
    """
    name = "scipy.linalg.cython_blas"
    if name in sys.modules:
        return
    try:
        import importlib.machinery
        import importlib.util
        spec = importlib.util.find_spec("scipy")  # a top-level find imports nothing
        for root in (spec.submodule_search_locations or []) if spec else []:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = os.path.join(root, "linalg", "cython_blas" + suffix)
                if os.path.isfile(path):
                    blas = importlib.util.spec_from_file_location(name, path)
                    module = importlib.util.module_from_spec(blas)
                    sys.modules[name] = module
                    blas.loader.exec_module(module)
                    return
    except Exception:
        sys.modules.pop(name, None)


def load_extension(module: str, reference, who: str):
    """``(implementation, compiled?)``: the compiled module ``hpcps.kernels.<module>``, or
    ``reference`` when HPCPS_NO_EXTENSION=1 or the extension is not built (then with one
    warning naming ``who`` and how to build)."""
    if os.environ.get("HPCPS_NO_EXTENSION") == "1":
        return reference, False
    try:
        _load_cython_blas_alone()
        return importlib.import_module(f"hpcps.kernels.{module}"), True
    except ImportError as exc:
        warnings.warn(
            f"{who}: compiled kernels not available ({exc}); using the NumPy "
            "reference, which runs slower. Build them with `pip install -e .` or "
            "`python setup.py build_ext --inplace` in the hpcps source tree.",
            RuntimeWarning,
            stacklevel=3,
        )
        return reference, False


_impl, HAVE_EXTENSION = load_extension("_adagrad", reference, "hpcps.kernels")

__all__ = ["HAVE_EXTENSION", "adagrad_update", "sgd_update"]


def _check_array(name, a, writable, ndim=1, dtype=np.float32):
    """A C-contiguous ndarray of ``dtype`` (float32 unless given) and ``ndim`` dimensions
    (any when None), writable if it is written."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (strided views are refused; pass a copy)")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is updated in place but is read-only")


def _check_arrays(written, read):
    """Check every array, then that lengths agree and that no written array overlaps another.

    For 1-D contiguous arrays ``np.may_share_memory`` (a bounds comparison) is exact.
    """
    for name, a in written:
        _check_array(name, a, writable=True)
    for name, a in read:
        _check_array(name, a, writable=False)
    arrays = written + read
    n = arrays[0][1].shape[0]
    if any(a.shape[0] != n for _, a in arrays):
        lengths = ", ".join(f"{name} has {a.shape[0]}" for name, a in arrays)
        raise ValueError(f"length mismatch: {lengths} elements")
    _check_no_overlap(written, read)


def _check_no_overlap(written, others):
    """No written array may share memory with any other operand."""
    arrays = written + others
    for i, (name, a) in enumerate(written):
        for other, b in arrays[i + 1:]:
            if np.may_share_memory(a, b):
                raise ValueError(f"{name} and {other} overlap in memory; pass separate arrays")


def _check_scalar(name, x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {x!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def _check_threads(threads):
    try:
        threads = operator.index(threads)
    except TypeError:
        raise ValueError(f"threads must be an integer, got {threads!r}") from None
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


def adagrad_update(w, g, accum, lr, eps, threads=1):
    """Apply one Adagrad step in place: ``accum += g*g; w -= lr*g / (sqrt(accum) + eps)``.

    DistBelief's Adagrad: each parameter's step is ``lr`` over the root of the sum of its
    squared gradients, so parameters that see large or frequent gradients slow down and
    rare ones keep a large step; ``eps`` only keeps ``0/0`` out.

    Parameters
    ----------
    w : numpy.ndarray
        1-D float32 C-contiguous parameters, updated in place.
    g : numpy.ndarray
        1-D float32 C-contiguous gradient of the same length, read only.
    accum : numpy.ndarray
        1-D float32 C-contiguous sum of squared gradients (start at zero, or at a small
        positive value), updated in place.
    lr : float
        Learning rate, finite; negative values are accepted (the step then ascends).
    eps : float
        Finite and >= 0; with ``eps == 0`` a parameter whose accumulator and gradient are
        both zero becomes NaN.
    threads : int, optional
        OpenMP threads for the compiled kernel (default 1, because server ranks usually
        share cores); the NumPy fallback ignores it.

    Raises
    ------
    ValueError
        If an array is not 1-D float32 C-contiguous, the lengths differ, a written array is
        read-only or overlaps another, ``lr``/``eps`` are not finite, ``eps < 0`` or
        ``threads < 1``.
    """
    _check_arrays([("w", w), ("accum", accum)], [("g", g)])
    lr = _check_scalar("lr", lr)
    eps = _check_scalar("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    threads = _check_threads(threads)
    _impl.adagrad_update(w, g, accum, lr, eps, threads)


def sgd_update(w, g, lr):
    """Apply one plain SGD step in place: ``w -= lr * g``.

    Parameters
    ----------
    w : numpy.ndarray
        1-D float32 C-contiguous parameters, updated in place.
    g : numpy.ndarray
        1-D float32 C-contiguous gradient of the same length, read only.
    lr : float
        Learning rate, finite.

    Raises
    ------
    ValueError
        If an array is not 1-D float32 C-contiguous, the lengths differ, ``w`` is read-only
        or overlaps ``g``, or ``lr`` is not finite.
    """
    _check_arrays([("w", w)], [("g", g)])
    lr = _check_scalar("lr", lr)
    _impl.sgd_update(w, g, lr)
