"""What every adapter returns: the hook handles it registered and the patches it made, undone
together when the capture ends."""

from __future__ import annotations

from typing import Any, Callable, List


class Hooks:
    """What an adapter returns: hook handles to remove and patches to undo."""

    def __init__(self) -> None:
        self.handles: List[Any] = []
        self.undo: List[Callable[[], None]] = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for u in reversed(self.undo):
            u()
