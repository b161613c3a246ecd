"""Where a connector's slab <-> engine copies run: off the engine's stream and thread.

The engine's forward pass must not wait for rdmakv's copies, and rdmakv's
copies must not read KV the forward has not written yet. A :class:`CopyStream`
gives both, the same way on every device, so the CPU tests exercise the logic
a GPU runs:

* on CUDA, copies run on a side stream. :meth:`CopyStream.engine_mark`
  (engine thread, non-blocking) records an event on the engine's current
  stream after its forward; :meth:`CopyStream.run` (transfer thread) makes the
  side stream wait for that event, issues the copies on it, and waits for the
  side stream's own event before returning, so when it returns the bytes have
  landed and the transfer thread may hand the slab blocks to the network or
  report the engine blocks as loaded;
* on the CPU there is no stream: the engine's forward has finished when the
  mark is taken, and :meth:`CopyStream.run` runs the copies on the calling
  (transfer) thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class CopyStream:
    """Runs copies for one device (see the module docstring). Not thread-safe by
    itself: one transfer thread calls :meth:`run`; the engine thread calls
    :meth:`engine_mark`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None
        if device.type == "cuda":
            import torch

            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @property
    def on_side_stream(self) -> bool:
        return self._stream is not None

    def engine_mark(self) -> Any:
        """A marker of "the engine's work so far" (a CUDA event; None on the CPU)."""
        if self._stream is None:
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run(self, copies: Callable[[], None], after: Any = None) -> None:
        """Run ``copies`` after the engine work ``after`` marks; return once they completed."""
        if self._stream is None:
            copies()
            return
        import torch

        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            copies()
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        done.synchronize()


__all__ = ["CopyStream"]
