"""Die with the launching process: a child started by :class:`splitserve.launcher.Cluster` asks the kernel for
SIGTERM when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``), so a killed ``splitserve up`` or test run leaves
no orphaned workers.

The child does it itself, first thing in ``splitserve.cli.main``, instead of the launcher's ``preexec_fn``: a
``preexec_fn`` makes ``subprocess`` fork() (not vfork/posix_spawn) a parent that runs gRPC and UCX threads, and the
fork handlers in the child can hang it before exec (seen: a child spinning at 100% CPU for good, holding up its
launcher). ``PARENT_PID_ENV`` names the parent; a parent that already exited before the request was made (the
race prctl leaves open) ends the child at once.
"""

from __future__ import annotations

import ctypes
import os
import signal

#: set by the launcher for each child it starts: its own pid
PARENT_PID_ENV = "SPLITSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def arm_from_env() -> bool:
    """If started by a launcher (``PARENT_PID_ENV`` set), get SIGTERM when that parent exits; exit now (SIGTERM to
    itself) when it already has. Removes the variable, so this process's own children do not inherit it. Returns
    whether the death signal was armed (False: not started by a launcher, or not Linux)."""
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return False
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return False
    if os.getppid() != int(parent):  # the parent died before prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)
    return True
