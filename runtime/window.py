"""A window over a stream of frames, kept in a preallocated ring buffer.

A model that takes the last ``length`` frames of a stream (a CNN, TCN or transformer over
time, a policy over stacked observations) is driven by a device that streams one frame at
a time. :class:`FrameWindow` keeps every frame twice in a ring of ``2 * length`` rows, so
the last ``length`` frames are always one contiguous slice, oldest first; when the window
is due (the first ``length`` frames have arrived, then every ``hop`` frames) it copies that
slice into the model's input, transposed for a channel-major input. Nothing is allocated
per frame: the slices are made once.

>>> import numpy as np
>>> x = np.zeros((1, 3, 2), dtype=np.float32)          # (batch, length, features), time-major
>>> w = FrameWindow(x, length=3, hop=2, layout="time_major")
>>> [w.push(np.array([i, -i], dtype=np.float32)) for i in range(6)]
[False, False, True, False, True, False]
>>> x[0, :, 0]                                        # the window written after frame 4: frames 2, 3, 4
array([2., 3., 4.], dtype=float32)
"""

from __future__ import annotations

import numpy as np


class FrameWindow:
    """The last ``length`` frames of a stream, written into ``target`` every ``hop`` frames.

    ``target`` is the model's input buffer (C-contiguous), ``(1, length, features...)`` for
    ``time_major`` or ``(1, features..., length)`` for ``channel_major``; the features may span
    several axes (``(1, 1, channels, length)``) or none (``(1, length)``: one value per frame), and a
    frame is ``features`` values, their product (any shape with that many elements).
    """

    def __init__(self, target: np.ndarray, length: int, hop: int = 1, layout: str = "time_major"):
        if layout not in ("time_major", "channel_major"):
            raise ValueError(f"window layout {layout!r} is not 'time_major' or 'channel_major'")
        if target.ndim < 2 or target.shape[0] != 1 or not target.flags.c_contiguous:
            raise ValueError(f"a window's input buffer is a C-contiguous (1, length, features...), "
                             f"(1, features..., length) or (1, length), got shape {target.shape}")
        time_axis = 1 if layout == "time_major" else target.ndim - 1
        if target.shape[time_axis] != length:
            raise ValueError(f"the input has {target.shape[time_axis]} frames on its {layout} time axis, "
                             f"the window {length}")
        self.length, self.hop, self.layout = int(length), int(hop), layout
        self.features = int(target[0].size // self.length)
        self._ring = np.zeros((2 * self.length, self.features), dtype=target.dtype)
        # destination: a (length, features) view either way (the feature axes flattened in C order, which
        # reshaping a contiguous buffer does without a copy); channel-major writes through its transpose
        self._dest = (target[0].reshape(self.length, self.features) if layout == "time_major"
                      else target[0].reshape(self.features, self.length).T)
        self._windows = [self._ring[p : p + self.length] for p in range(self.length)]
        self._rows = [(self._ring[p], self._ring[p + self.length]) for p in range(self.length)]
        self.reset()

    def reset(self) -> None:
        """Forget every frame (a new trial): the window is due again after ``length`` frames."""
        self._ring.fill(0)
        self._pos = 0
        self.count = 0

    def push(self, frame: np.ndarray) -> bool:
        """Add one frame; return whether the window was due and has been written into the input."""
        a, b = self._rows[self._pos]
        flat = frame if frame.ndim == 1 else frame.reshape(-1)  # no view made for the usual 1-D frame
        if flat.size != self.features:
            raise ValueError(f"a frame of {flat.size} values does not fit a window of {self.features} features per frame")
        np.copyto(a, flat, casting="same_kind")
        np.copyto(b, flat, casting="same_kind")
        self._pos = self._pos + 1 if self._pos + 1 < self.length else 0
        self.count += 1
        if self.count < self.length or (self.count - self.length) % self.hop:
            return False
        np.copyto(self._dest, self._windows[self._pos])
        return True

    @property
    def frames(self) -> np.ndarray:
        """The frames now in the window, oldest first (a view; zeros before ``length`` frames arrived)."""
        return self._windows[self._pos]
