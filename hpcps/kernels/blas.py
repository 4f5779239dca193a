"""Which library's sgemm the compiled kernels call: OpenBLAS (scipy's) or Intel MKL.

The Hogwild engine (``ext/hogwild.pyx``) and the GEMM kernels (``ext/gemm.pyx``) call
single-threaded Fortran ``sgemm`` without the GIL, by default
``scipy.linalg.cython_blas.sgemm`` (OpenBLAS). Both hold that sgemm in a function pointer,
which :func:`use` can point at MKL's instead. On this machine (Xeon, AVX-512, one core,
MKL 2026.2 against scipy's OpenBLAS, medians of per-round ratios with the two calls back to
back) MKL's sgemm was 1.05x, 1.22x and 1.49x faster at the forward products of an MLP
784-1024-1024-10, batch 128 (784x1024, 1024x1024, 1024x10 weights) and 1.26x, 1.33x at
the weight gradients ``X.T @ D`` (``bench/bench_gemm.py``); the Hogwild engine on MNIST
trained 1.07x (T=1) and 1.11x (T=2) faster with it for that model, 1.13x and 1.14x for
784-512-512-10. Hence the default ``auto``.

MKL comes from the PyPI ``mkl`` wheel (``pip install "hpcps[mkl]"``; it puts
``libmkl_rt.so.3`` in ``<sys.prefix>/lib``) or from anywhere ``ctypes.util.find_library``
finds ``mkl_rt``. It is loaded with ctypes and set, before any other MKL call, to the LP64
interface (32-bit integers, as the kernels pass) and the SEQUENTIAL threading layer: every
thread that calls it is one of our own (Hogwild threads, OpenMP threads over tiles), so
MKL must not start threads of its own. A small product is checked against NumPy before the
kernels are pointed at it.

Environment
-----------
HPCPS_BLAS = auto | mkl | openblas
    Read once, when the first compiled kernel or engine needs sgemm (not at import: see
    "PyTorch" below), or at the first :func:`current`; an explicit :func:`use` wins.
    ``auto`` (the default) is MKL when it loads, else OpenBLAS; ``mkl`` raises
    :class:`hpcps.errors.ConfigError` when MKL cannot be loaded.

PyTorch
-------
PyTorch's wheels link MKL statically and import their libraries privately (RTLD_LOCAL),
so loading MKL after ``import torch`` is safe: each keeps its own copy. ``libmkl_rt``,
however, opens its layers with RTLD_GLOBAL, so if MKL is loaded *first*, a later
``import torch`` binds thousands of torch's MKL symbols to this MKL (another version,
SEQUENTIAL: torch's GEMMs then ignore ``torch.set_num_threads``). Hence MKL is loaded
lazily, and a later ``import torch`` is warned about (RuntimeWarning): import torch first,
or set ``HPCPS_BLAS=openblas``.

Without the compiled kernels (not built, or ``HPCPS_NO_EXTENSION=1``) the NumPy fallbacks
use NumPy's BLAS and the choice here changes nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.abc
import os
import sys
import threading
import warnings

import numpy as np

from hpcps.errors import ConfigError

NAMES = ("openblas", "mkl", "auto")
DEFAULT = "auto"
ENV = "HPCPS_BLAS"

# mkl_service.h
_MKL_INTERFACE_LP64, _MKL_INTERFACE_ILP64 = 0, 1
_MKL_THREADING_SEQUENTIAL = 1
# the compiled modules whose sgemm pointer is set
_EXTENSIONS = ("_gemm", "_hogwild")

_lock = threading.RLock()
_current: str | None = None     # "openblas" or "mkl" once chosen
_mkl: dict | None = None        # {"path", "version", "sgemm"} once MKL is loaded
mkl_error: str | None = None    # why MKL did not load, when it did not

__all__ = ["DEFAULT", "NAMES", "current", "ensure", "info", "use"]


def _mkl_candidates():
    """Paths (or sonames) to try for libmkl_rt, in order."""
    lib = os.path.join(sys.prefix, "lib")
    cands = [os.path.join(lib, n) for n in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")]
    found = ctypes.util.find_library("mkl_rt")
    if found:
        cands.append(found)
    return cands


def _check_sgemm(address):
    """Run a small product with two transposes through the sgemm at ``address`` and
    compare it with NumPy: catches a library answering with 64-bit integers (ILP64)."""
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 13)(address)
    rng = np.random.default_rng(0)
    m, n, k = 5, 3, 7
    a = np.asfortranarray(rng.standard_normal((k, m)), dtype=np.float32)   # op(A) = A^T
    b = np.asfortranarray(rng.standard_normal((n, k)), dtype=np.float32)   # op(B) = B^T
    c = np.asfortranarray(np.full((m, n), 0.5), dtype=np.float32)
    want = 2.0 * (a.T.astype(np.float64) @ b.T) + 0.25 * 0.5

    def i(v):
        return ctypes.byref(ctypes.c_int(v))

    fn(ctypes.c_char_p(b"T"), ctypes.c_char_p(b"T"), i(m), i(n), i(k),
       ctypes.byref(ctypes.c_float(2.0)), a.ctypes.data, i(k), b.ctypes.data, i(n),
       ctypes.byref(ctypes.c_float(0.25)), c.ctypes.data, i(m))
    return bool(np.allclose(c, want, rtol=1e-5, atol=1e-5))


def _load_mkl():
    """Load libmkl_rt (LP64, SEQUENTIAL) once; return its sgemm's address.

    Raises ConfigError saying why when it cannot.
    """
    global _mkl, mkl_error
    if _mkl is not None:
        return _mkl["sgemm"]
    tried = []
    lib = path = None
    for cand in _mkl_candidates():
        if os.sep in cand and not os.path.exists(cand):
            tried.append(f"{cand}: no such file")
            continue
        try:
            lib = ctypes.CDLL(cand)            # RTLD_LOCAL
        except OSError as exc:
            tried.append(f"{cand}: {exc}")
            continue
        path = cand
        break
    if lib is None:
        mkl_error = ("libmkl_rt not found (tried " + "; ".join(tried or ["nothing"]) +
                     "); install it with `pip install mkl` or `pip install hpcps[mkl]`")
        raise ConfigError(mkl_error)
    try:
        set_iface, set_thr = lib.MKL_Set_Interface_Layer, lib.MKL_Set_Threading_Layer
        sgemm = ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except AttributeError as exc:
        mkl_error = f"{path} is not a usable libmkl_rt ({exc})"
        raise ConfigError(mkl_error) from None
    set_iface.restype = set_thr.restype = ctypes.c_int
    set_iface.argtypes = set_thr.argtypes = [ctypes.c_int]
    # Both must come before any other MKL call; they return the layer in effect, which
    # differs from the one asked for when something in this process used MKL first.
    iface = set_iface(_MKL_INTERFACE_LP64)
    thr = set_thr(_MKL_THREADING_SEQUENTIAL)
    if iface < 0 or iface & _MKL_INTERFACE_ILP64 or thr != _MKL_THREADING_SEQUENTIAL:
        mkl_error = (f"{path} was already set up by another user in this process (interface "
                     f"layer {iface}, threading layer {thr}); hpcps needs LP64 and "
                     "SEQUENTIAL")
        raise ConfigError(mkl_error)
    if not _check_sgemm(sgemm):
        mkl_error = f"sgemm of {path} gave a wrong product (not the LP64 interface?)"
        raise ConfigError(mkl_error)
    version = None
    try:
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, ctypes.c_int(len(buf)))
        version = buf.value.decode(errors="replace").strip()
    except AttributeError:
        pass
    _mkl = {"path": path, "version": version, "sgemm": sgemm, "lib": lib}
    mkl_error = None
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, _LateTorchWarning())
    return sgemm


class _LateTorchWarning(importlib.abc.MetaPathFinder):
    """Warns once when torch is imported after MKL was loaded (see "PyTorch" above)."""

    done = False

    def find_spec(self, fullname, path=None, target=None):   # finds nothing: None
        if fullname == "torch" and not self.done:
            self.done = True   # stays in sys.meta_path, inert: removing it mid-import is unsafe
            warnings.warn(
                "torch is imported after hpcps loaded Intel MKL (HPCPS_BLAS=auto/mkl): "
                "libmkl_rt exports its symbols globally, so torch's statically linked MKL "
                "binds to this one (another version, single-threaded). Import torch "
                "before creating hpcps engines, or set HPCPS_BLAS=openblas.",
                RuntimeWarning, stacklevel=2)


def _point_extensions(address):
    """Point the compiled modules' sgemm at ``address`` (0: scipy's)."""
    if os.environ.get("HPCPS_NO_EXTENSION") == "1":
        return
    for name in _EXTENSIONS:
        try:
            mod = importlib.import_module(f"hpcps.kernels.{name}")
        except ImportError:
            continue
        mod._set_sgemm(address)


def use(name: str) -> str:
    """Make the compiled kernels call ``name``'s sgemm from now on; returns the library
    chosen (``"openblas"`` or ``"mkl"``).

    ``"auto"`` is MKL when it loads, else OpenBLAS. Call it while no kernel is running
    (the switch is one pointer per module, read by every sgemm call).

    Raises
    ------
    ConfigError
        On a name not in ``NAMES``, or ``"mkl"`` when MKL cannot be loaded (``mkl_error``
        says why).
    """
    global _current
    if not isinstance(name, str) or name.strip().lower() not in NAMES:
        raise ConfigError(f"unknown BLAS {name!r}; choose one of {NAMES}")
    name = name.strip().lower()
    with _lock:
        if name == "openblas":
            address = 0
        elif name == "mkl":
            address = _load_mkl()
        else:
            try:
                address = _load_mkl()
            except ConfigError:
                name, address = "openblas", 0
            else:
                name = "mkl"
        _point_extensions(address)
        _current = name
        return name


def ensure() -> str:
    """Choose the BLAS from ``HPCPS_BLAS`` (default ``DEFAULT``) unless already chosen;
    returns the library in use. Called by the kernels and the engine before first use."""
    if _current is not None:
        return _current
    with _lock:
        if _current is not None:
            return _current
        want = os.environ.get(ENV, "").strip() or DEFAULT
        if want.lower() not in NAMES:
            raise ConfigError(f"{ENV}={want!r}: choose one of {NAMES}")
        try:
            return use(want)
        except ConfigError as exc:
            raise ConfigError(f"{ENV}={want}: Intel MKL cannot be used: {exc}; or set "
                              f"{ENV}=openblas (or auto: MKL when it loads)") from None


def current() -> str:
    """The library the compiled kernels' sgemm comes from: ``"openblas"`` or ``"mkl"``
    (choosing it from ``HPCPS_BLAS`` first if nothing has yet)."""
    return ensure()


def info() -> dict:
    """``{"blas": current(), "mkl_path", "mkl_version", "mkl_error"}`` for reports."""
    name = current()
    return {"blas": name,
            "mkl_path": _mkl["path"] if _mkl else None,
            "mkl_version": _mkl["version"] if _mkl else None,
            "mkl_error": mkl_error}
