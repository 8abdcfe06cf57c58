"""How a helper process (the engine, a tensor-parallel worker) lives and dies with its parent.

systemd's default ``KillMode=control-group``, container inits (``tini -g``, ``dumb-init``),
``kill -- -PGID`` and Ctrl-C signal every process of the server at once. Only the parent
decides how to stop: it drains, then tells its children. So a child ignores SIGTERM and
SIGINT, and ends when its parent tells it to or when its parent is gone::

    parent:  with stop_signals_blocked(): spawn child     # no window before the child ignores them
    child:   ignore_stop_signals(); exit_with_parent()    # first thing it runs
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PARENT_POLL_S = 0.5


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGTERM and SIGINT in this thread while a child is spawned.

    A child inherits the signal mask through fork and exec, so it starts with them blocked until
    ``ignore_stop_signals`` discards them. The parent loses nothing: a signal sent meanwhile is
    handled by another thread, or by this one once the block lifts.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT from now on (pending ones are discarded), then unblock them.
    Children spawned later inherit the ignoring."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def exit_with_parent(poll_s: float = _PARENT_POLL_S) -> None:
    """Exit (code 1) within ``poll_s`` of the parent's death, even a SIGKILL: a watching thread
    sees this process re-parented. Nothing is left to save once the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="expresslane-parent-watch", daemon=True).start()
