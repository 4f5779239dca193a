"""Training-time data augmentation of image rows: random translations (``--augment shift:K``).

Each training image (a row of x, flattened C, H, W as the dataset's ``image_shape`` says) is
moved by a whole number of pixels drawn for that example, dy and dx uniform in [-K, K]; the
pixels moved in from outside the image are 0. ``out[c, i, j] = x[c, i - dy, j - dx]``. The
evaluation splits are never augmented. Simard, Steinkraus and Platt (2003) and Ciresan et al.
(2010) train MNIST networks on such distortions; a translation of one or two pixels keeps a
digit a digit.

:class:`Augmented` wraps any endless iterator of ``(x, y)`` batches (in memory or streamed) and
draws the shifts from its own seeded generator, so every partition of a replica (they draw the
same batches from the same seed) moves every example the same way. Pure NumPy; no MPI.
"""
from __future__ import annotations

import numpy as np

from hpcps.errors import ConfigError
from hpcps.options import Shift


def check_image_shape(aug: Shift, image_shape, path: str) -> None:
    """Refuse ``--augment`` (parsed by :func:`hpcps.options.parse_augment`) on data without
    images, or a shift as large as the image (``image_shape`` as the dataset's info gives it,
    already checked against the rows' width)."""
    if image_shape is None:
        raise ConfigError(f"--augment {aug.text} moves images, and {path} declares no "
                          "image_shape (its rows are not images): drop --augment, or write "
                          "the data with their image shape (python -m hpcps.data convert "
                          "--image-shape C,H,W)")
    _, h, w = (int(v) for v in image_shape)
    if aug.k >= min(h, w):
        raise ConfigError(f"--augment {aug.text}: a shift of {aug.k} pixels would move a "
                          f"{h}x{w} image out of itself; give at most {min(h, w) - 1}")


def shift_images(x: np.ndarray, image_shape, dy: np.ndarray, dx: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Rows of ``x`` (B, C*H*W) with image b moved down by ``dy[b]`` and right by ``dx[b]``
    pixels (negative: up, left), zeros moved in; a new (B, C*H*W) array of x's dtype (or
    ``out``)."""
    c, h, w = (int(v) for v in image_shape)
    b = len(x)
    imgs = x.reshape(b, c, h, w)
    if out is None:
        out = np.empty((b, c * h * w), dtype=x.dtype)
    moved = out.reshape(b, c, h, w)
    moved[...] = 0
    # one slice copy per distinct move, of the images that move that way: rows i >= dy read
    # row i - dy (dy >= 0), rows i < h + dy read i - dy (dy < 0); the same for columns
    dy, dx = np.asarray(dy, dtype=np.int64), np.asarray(dx, dtype=np.int64)
    span = 2 * max(int(np.abs(dy).max(initial=0)), int(np.abs(dx).max(initial=0))) + 1
    moves = dy * span + dx
    for move in np.unique(moves):
        which = np.flatnonzero(moves == move)
        my, mx = int(dy[which[0]]), int(dx[which[0]])
        if abs(my) >= h or abs(mx) >= w:
            continue  # moved out entirely: zeros
        dst = (slice(max(my, 0), h + min(my, 0)), slice(max(mx, 0), w + min(mx, 0)))
        src = (slice(max(-my, 0), h + min(-my, 0)), slice(max(-mx, 0), w + min(-mx, 0)))
        moved[which, :, dst[0], dst[1]] = imgs[which, :, src[0], src[1]]
    return out


class Augmented:
    """An endless iterator of ``(x, y)`` batches, each image moved by :func:`shift_images`
    with shifts drawn from ``np.random.default_rng(seed)``. Every other attribute (``epoch``,
    ``epochs_done``, ``close``) is the wrapped iterator's."""

    def __init__(self, batches, aug: Shift, image_shape, seed: int):
        self._batches = batches
        self.aug = aug
        self.image_shape = tuple(int(v) for v in image_shape)
        self._rng = np.random.default_rng([int(seed), 0x5A1F7])  # apart from the batch order

    def __iter__(self) -> Augmented:
        return self

    def __next__(self):
        x, y = next(self._batches)
        k = self.aug.k
        dy = self._rng.integers(-k, k + 1, len(x))
        dx = self._rng.integers(-k, k + 1, len(x))
        return shift_images(x, self.image_shape, dy, dx), y

    def __getattr__(self, name):
        return getattr(self._batches, name)
