"""Which library's sgemm the compiled kernels call: OpenBLAS (scipy's) or Intel MKL.

The Hogwild engine (``ext/hogwild.pyx``) and the GEMM kernels (``ext/gemm.pyx``) call
single-threaded Fortran ``sgemm`` without the GIL, by default
``scipy.linalg.cython_blas.sgemm`` (OpenBLAS). Both hold that sgemm in a function pointer,
which :func:`use` can point at MKL's instead.

Which is faster depends on the CPU: on an AVX-512 Xeon MKL's sgemm ran 1.05-1.49x
OpenBLAS's at an MLP's training shapes, on an AMD EPYC (AVX2) 0.88-0.94x
(``docs/performance.md``). So ``auto``, the default, does not guess: when MKL loads, it
times both libraries' sgemm, through the kernels' own pointer, on the calls one training
step of the model makes (:func:`mlp_shapes`: each layer's forward, error and update
products, as the engine calls them, given by the first Hogwild engine, without the first
layer's when it skips zeros; an MLP 784-512-512-10 at batch 128 when the first caller knows
no model), in rounds that alternate which library goes first, and keeps the one faster at
each product's fastest round (:func:`decide`). That takes 0.05-0.5 s, once per process
(:data:`TIME_BUDGET_S`). :func:`info` says what was chosen and why.

MKL comes from the PyPI ``mkl`` wheel (``pip install "hpcps[mkl]"``; it puts
``libmkl_rt.so.3`` in ``<sys.prefix>/lib``) or from anywhere the dynamic loader finds
``libmkl_rt.so.3``, ``.so.2`` or ``.so`` (``LD_LIBRARY_PATH``, as a cluster's ``module
load`` sets it, and the ld.so cache). It is loaded with ctypes and set, before any other MKL
call, to the LP64 interface (32-bit integers, as the kernels pass) and the SEQUENTIAL
threading layer: every thread that calls it is one of our own (Hogwild threads, OpenMP
threads over tiles), so MKL must not start threads of its own. A small product is checked
against NumPy before the kernels are pointed at it.

Environment
-----------
HPCPS_BLAS = auto | mkl | openblas
    Read once, when the first compiled kernel or engine needs sgemm (not at import: see
    "PyTorch" below), or at the first :func:`current`; an explicit :func:`use` wins.
    ``auto`` (the default) times both at the model's shapes when MKL loads (above), else
    is OpenBLAS; ``mkl`` raises :class:`hpcps.errors.ConfigError` when MKL cannot be
    loaded.

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

import contextlib
import ctypes
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import time
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
_EXTENSIONS = ("_gemm", "_hogwild", "_convnet")

# auto's timing: rounds of every shape with each library, at least MIN_ROUNDS and at most
# MAX_ROUNDS, stopping once TIME_BUDGET_S has passed; dimensions are clipped at MAX_DIM
# (sgemm's speed is flat beyond a few hundred, and the budget must hold for any model)
MIN_ROUNDS, MAX_ROUNDS, TIME_BUDGET_S, MAX_DIM = 3, 15, 0.4, 2048
DEFAULT_MODEL, DEFAULT_BATCH = (784, 512, 512, 10), 128

_lock = threading.RLock()
_current: str | None = None     # "openblas" or "mkl" once chosen
_reason: str | None = None      # why, in words, once chosen
_timing: dict | None = None     # auto's measurement, when it timed
_mkl: dict | None = None        # {"path", "version", "sgemm"} once MKL is loaded
mkl_error: str | None = None    # why MKL did not load, when it did not

__all__ = ["DEFAULT", "NAMES", "current", "decide", "ensure", "info", "mlp_shapes",
           "summary", "time_sgemm", "use"]


def _mkl_candidates():
    """Paths (or sonames) to try for libmkl_rt, in order: the files under sys.prefix, then
    the sonames, which the dynamic loader looks for on its own search path. (Not
    ``ctypes.util.find_library``: it starts ldconfig, gcc and ld, 30 ms of CPU time and more
    in every rank, forked after MPI_Init, which some interconnects' MPI warn about; and a
    library it finds only on gcc's link path would not load at run time anyway.)"""
    lib = os.path.join(sys.prefix, "lib")
    names = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
    return [*(os.path.join(lib, name) for name in names), *names]


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
            absent = os.sep not in cand and f"{cand}: cannot open shared object" in str(exc)
            tried.append(f"{cand}: not on the loader's path (LD_LIBRARY_PATH, ld.so cache)"
                         if absent else f"{cand}: {exc}")
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


def mlp_shapes(sizes, batch, first_layer=True):
    """The sgemm calls one training step of the Hogwild engine makes for an MLP with layer
    widths ``sizes`` and mini-batch ``batch``, as ``(m, k, n, trans_a, trans_b, beta)``:
    ``out (m, n) = op(A) (m, k) @ op(B) (k, n) + beta * out``. Per layer: the forward
    ``X @ W`` (into the bias, beta 1), the error's ``D @ W.T`` (not in the first layer) and
    the update ``X.T @ D`` (into the weights, beta 1). ``first_layer=False`` leaves out the
    first layer's forward and update (the zero-skipping kernels do them). Dimensions are
    clipped at ``MAX_DIM``; repeats are listed once."""
    shapes = []
    for l, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        b, i, o = (min(int(v), MAX_DIM) for v in (batch, n_in, n_out))
        calls = [(b, o, i, False, True, 0.0)] if l > 0 else []
        if l > 0 or first_layer:
            calls += [(b, i, o, False, False, 1.0), (i, b, o, True, False, 1.0)]
        shapes += [c for c in calls if c not in shapes]
    return tuple(shapes)


def time_sgemm(addresses, shapes, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS,
               budget_s=TIME_BUDGET_S):
    """Seconds each sgemm (``{name: address}``, 0 for scipy's) takes for all ``shapes`` (as
    :func:`mlp_shapes`), called as the kernels call it, one thread.

    One warm-up pass each, then rounds: every library does every shape once, the order of
    the libraries turning each round so drifting load hits both alike. Returns
    ``{"rounds": [{name: [seconds per shape]}, ...], "seconds": wall time spent}``.
    """
    from hpcps.kernels import _gemm
    rng = np.random.default_rng(0)
    problems = []
    for m, k, n, trans_a, trans_b, beta in shapes:
        problems.append((rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32),
                         rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32),
                         np.zeros((m, n), np.float32), trans_a, trans_b, beta))
    names = list(addresses)

    def one_pass(name):
        _gemm._set_sgemm(addresses[name])
        times = []
        for a, b, out, trans_a, trans_b, beta in problems:
            t0 = time.perf_counter()
            _gemm.sgemm_blas(a, b, out, trans_a, trans_b, 1e-3, beta)
            times.append(time.perf_counter() - t0)
        return times

    start = time.perf_counter()
    rounds = []
    with OneThread()():  # as every kernel calls it
        for name in names:
            one_pass(name)
        while len(rounds) < max_rounds and (len(rounds) < min_rounds
                                            or time.perf_counter() - start < budget_s):
            order = names if len(rounds) % 2 == 0 else names[::-1]
            rounds.append({name: one_pass(name) for name in order})
    return {"rounds": rounds, "seconds": time.perf_counter() - start}


class OneThread:
    """``with OneThread()(): ...``: every BLAS library the process had loaded when this was
    made runs one thread inside the block (ours call sgemm from their own threads), as
    before after it. Found once with ``threadpoolctl`` (nothing is limited without it); each
    block reads the libraries' thread counts and sets only those above one, a few
    microseconds where ``threadpoolctl``'s own ``limit`` re-reads every library's
    description on each call (about 50 us, 2% of a 784-512-512-10 mini-batch)."""

    def __init__(self):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            self.libraries = []
        else:
            self.libraries = [lib for lib in ThreadpoolController().lib_controllers
                              if lib.user_api == "blas"]

    @contextlib.contextmanager
    def __call__(self):
        changed = [(lib, n) for lib in self.libraries if (n := lib.num_threads) != 1]
        for lib, _ in changed:
            lib.set_num_threads(1)
        try:
            yield
        finally:
            for lib, n in changed:
                lib.set_num_threads(n)


def best_seconds(rounds, name):
    """Seconds of one step's calls with ``name``: each shape's fastest round, summed."""
    return sum(min(per_shape) for per_shape in zip(*(r[name] for r in rounds)))


def decide(rounds):
    """``(name, mkl_speed)``: MKL when it is faster over ``rounds`` (each ``{"openblas":
    [seconds per shape], "mkl": [...]}``), else OpenBLAS. ``mkl_speed`` is OpenBLAS's
    :func:`best_seconds` over MKL's. The fastest of a shape's rounds is the one other jobs
    disturbed least: on a loaded machine (load 10 on 2 cores) medians of paired rounds
    ranged 0.68-1.2 over five choices for one model, so a median would pick at random."""
    mkl = best_seconds(rounds, "mkl")
    speed = best_seconds(rounds, "openblas") / mkl if mkl > 0 else 1.0   # no calls: a tie
    return ("mkl" if speed > 1.0 else "openblas"), speed


def _describe_shapes(shapes):
    return ", ".join(f"{m}x{k}{'^T' if ta else ''} @ {k}x{n}{'^T' if tb else ''}"
                     f"{' + C' if beta else ''}" for m, k, n, ta, tb, beta in shapes)


def use(name: str, shapes=None, source: str | None = None) -> str:
    """Make the compiled kernels call ``name``'s sgemm from now on; returns the library
    chosen (``"openblas"`` or ``"mkl"``).

    ``"auto"`` times both libraries at ``shapes`` (as :func:`mlp_shapes`; default: an MLP
    784-512-512-10 at batch 128) when MKL loads and keeps the faster, else is OpenBLAS.
    ``source`` (e.g. ``"HPCPS_BLAS=auto"``) heads the reason :func:`info` gives. Call it
    while no kernel is running (the switch is one pointer per module, read by every sgemm
    call).

    Raises
    ------
    ConfigError
        On a name not in ``NAMES``, or ``"mkl"`` when MKL cannot be loaded (``mkl_error``
        says why).
    """
    global _current, _reason, _timing
    if not isinstance(name, str) or name.strip().lower() not in NAMES:
        raise ConfigError(f"unknown BLAS {name!r}; choose one of {NAMES}")
    name = name.strip().lower()
    source = source or f"use({name!r})"
    with _lock:
        timing = None
        if name == "openblas":
            address, reason = 0, f"{source}: asked for"
        elif name == "mkl":
            address, reason = _load_mkl(), f"{source}: asked for"
        else:
            try:
                mkl = _load_mkl()
            except ConfigError:
                name, address = "openblas", 0
                reason = f"{source}: MKL cannot be used ({mkl_error})"
            else:
                name, address, timing, reason = _time_and_choose(mkl, shapes, source)
        _point_extensions(address)
        _current, _reason, _timing = name, reason, timing
        return name


def _time_and_choose(mkl, shapes, source):
    """auto with MKL loaded: ``(name, address, timing, reason)``."""
    if os.environ.get("HPCPS_NO_EXTENSION") == "1" or \
            importlib.util.find_spec("hpcps.kernels._gemm") is None:
        return "openblas", 0, None, f"{source}: the compiled kernels are not used"
    model = shapes is None
    shapes = mlp_shapes(DEFAULT_MODEL, DEFAULT_BATCH) if model else tuple(shapes)
    measured = time_sgemm({"openblas": 0, "mkl": mkl}, shapes)
    name, speed = decide(measured["rounds"])
    speed = round(speed, 3)  # one figure for the reason and the timing record alike
    what = (f"an MLP {'-'.join(map(str, DEFAULT_MODEL))} at batch {DEFAULT_BATCH}" if model
            else "this model")
    rounds = measured["rounds"]
    reason = (f"{source}: timed both at the sgemm shapes of {what} ({len(shapes)} "
              f"products): MKL ran {speed:.2f}x OpenBLAS's speed (each product's fastest of "
              f"{len(rounds)} alternating rounds, {measured['seconds']:.2f} s)")
    timing = {"shapes": _describe_shapes(shapes), "mkl_speed_over_openblas": speed,
              "rounds": len(rounds), "seconds": round(measured["seconds"], 3),
              "openblas_ms": round(1e3 * best_seconds(rounds, "openblas"), 3),
              "mkl_ms": round(1e3 * best_seconds(rounds, "mkl"), 3)}
    return name, (mkl if name == "mkl" else 0), timing, reason


def ensure(shapes=None) -> str:
    """Choose the BLAS from ``HPCPS_BLAS`` (default ``DEFAULT``) unless already chosen;
    returns the library in use. Called by the kernels and the engine before first use;
    ``shapes`` (as :func:`mlp_shapes`) are what ``auto`` times, when this call chooses."""
    if _current is not None:
        return _current
    with _lock:
        if _current is not None:
            return _current
        want = os.environ.get(ENV, "").strip() or DEFAULT
        if want.lower() not in NAMES:
            raise ConfigError(f"{ENV}={want!r}: choose one of {NAMES}")
        source = f"{ENV}={want}" if os.environ.get(ENV, "").strip() else f"{ENV} unset: {want}"
        try:
            return use(want, shapes, source)
        except ConfigError as exc:
            raise ConfigError(f"{ENV}={want}: Intel MKL cannot be used: {exc}; or set "
                              f"{ENV}=openblas (or auto: the faster when MKL loads)") from None


def current() -> str:
    """The library the compiled kernels' sgemm comes from: ``"openblas"`` or ``"mkl"``
    (choosing it from ``HPCPS_BLAS`` first if nothing has yet)."""
    return ensure()


def info() -> dict:
    """``{"blas": current(), "reason", "timing", "mkl_path", "mkl_version", "mkl_error"}``
    for reports: ``reason`` says why in words, ``timing`` is auto's measurement (None when
    it did not time)."""
    name = current()
    return {"blas": name,
            "reason": _reason,
            "timing": _timing,
            "mkl_path": _mkl["path"] if _mkl else None,
            "mkl_version": _mkl["version"] if _mkl else None,
            "mkl_error": mkl_error}


def summary() -> dict:
    """``{"blas": name, "blas_reason": why}``: the two fields a run's summary records."""
    current()
    return chosen()


def chosen() -> dict | None:
    """:func:`summary` if this process has chosen its BLAS (it ran a compiled kernel), else
    None (and nothing is chosen or timed here)."""
    return {"blas": _current, "blas_reason": _reason} if _current is not None else None
