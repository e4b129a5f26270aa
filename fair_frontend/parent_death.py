"""Children that end with this process: Linux's ``PR_SET_PDEATHSIG``.

A shell (``shell.process``) and the embedded Triton (``backends.triton.embedded``) are
children that serve nobody once the process that started them is gone; a parent that dies
without stopping them (SIGKILL, a crash, an OOM kill) would leave them holding their ports
and, for Triton, a GPU's memory. The kernel sends such a child its signal when the
*thread* that forked it ends, not the process: ``popen`` forks from a thread of its own
that lives as long as the process does, whichever thread asks (an event loop's executor
worker ends with its loop, a test's with the test).
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, *, parent: int | None = None) -> None:
    """Ask the kernel to send this process ``sig`` when its parent ends; elsewhere than
    Linux, nothing (the caller's other means apply: a shell's lost connection).

    ``parent``: the pid the caller expects as its parent (as a ``preexec_fn``, the pid of
    the process that forks); where the parent ended before the request was made (then the
    kernel never sends it), the signal is sent at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):  # not Linux
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


_forks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_forker: threading.Thread | None = None
_forker_lock = threading.Lock()


def _fork_forever() -> None:
    while True:
        call, result = _forks.get()
        try:
            result.set_result(call())
        except BaseException as err:  # the caller's to raise
            result.set_exception(err)


def popen(args: Any, sig: int = signal.SIGTERM, **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **kwargs)`` whose child is sent ``sig`` when this process
    ends, however it ends; forked by a daemon thread that lives as long as the process."""
    global _forker
    with _forker_lock:
        if _forker is None or not _forker.is_alive():
            _forker = threading.Thread(target=_fork_forever, name="forker", daemon=True)
            _forker.start()
    hook = functools.partial(die_with_parent, sig, parent=os.getpid())
    result: Future[subprocess.Popen[bytes]] = Future()
    _forks.put((functools.partial(subprocess.Popen, args, preexec_fn=hook, **kwargs), result))
    return result.result()
