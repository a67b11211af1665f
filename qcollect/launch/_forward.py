"""The workers' output, copied to the launcher's with a ``[rank r] `` prefix.

One thread per pipe, so that a worker that writes much cannot block on a
full pipe while another's lines wait; a lock shared by every forwarder keeps
lines whole.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import IO, TextIO


class Forwarder(threading.Thread):
    """Copies one pipe to ``sink`` line by line with a ``[rank r] `` prefix.

    ``watch``, if given, sees every line first (the launcher looks for what
    process 0 logs when the coordinator's port is taken).
    """

    lock = threading.Lock()

    def __init__(self, pipe: IO[bytes], sink: TextIO, prefix: str,
                 watch: Callable[[str], None] | None = None) -> None:
        super().__init__(daemon=True)
        self.pipe, self.sink, self.prefix, self.watch = pipe, sink, prefix, watch

    def run(self) -> None:
        """Forwards until the pipe closes, then closes it."""
        with contextlib.suppress(ValueError, OSError):
            for raw in iter(self.pipe.readline, b""):
                line = raw.decode("utf-8", "replace")
                if not line.endswith("\n"):
                    line += "\n"
                if self.watch is not None:
                    self.watch(line)
                with self.lock:
                    self.sink.write(self.prefix + line)
                    self.sink.flush()
        with contextlib.suppress(OSError):
            self.pipe.close()
