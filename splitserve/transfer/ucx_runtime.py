"""Process-wide UCX (ucxx) set-up: environment defaults, one idempotent init, clean shutdown.

Rules this module enforces (see /work/shared/notes/ucx-on-this-machine.md):

* ``ucxx.init(progress_mode="thread", enable_python_future=True)`` is called *inside the running event
  loop* (the notifier thread binds to it); called before ``asyncio.run`` transfers hang.
* UCX reads its environment when the context is created, so :func:`ucx_env_defaults` must be applied
  before that -- the launcher applies them (``setdefault``) to the environment of every worker process
  it spawns, and :func:`acquire` applies them again (``setdefault``) just before ``ucxx.init``.
* ``ucxx.stop_notifier_thread()`` must run before interpreter exit or the process hangs: :func:`release`
  does it when the last user closes, and an exit hook (run before non-daemon threads are joined) does it
  if a user forgot to close.
* Never fork after UCX initialisation: start worker processes with the ``spawn`` context.

Only this module calls ``ucxx.init``; senders and receivers call :func:`acquire` on start and
:func:`release` on close (reference counted). If ucxx was initialised by someone else, it is used as is
and never reset here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import MutableMapping

logger = logging.getLogger("splitserve.transfer.ucx")

_lock = threading.Lock()
_refs = 0
_owner = False  # we called ucxx.init (so we may stop/reset it)
_loop: asyncio.AbstractEventLoop | None = None
_exit_hook_installed = False


def ucx_env_defaults() -> dict[str, str]:
    """UCX / ucxx environment defaults for every process that moves KV bytes.

    Apply with ``setdefault`` so an operator's explicit setting wins. Deliberately *not* included:
    ``UCX_NET_DEVICES`` (tests on one machine set ``lo``; production must use the real NIC) and
    ``UCX_TLS`` (the default "all" keeps ``tcp``, which listener connections need).
    """
    return {
        # Listener endpoints always enable error handling, which disables shared memory unless this is set.
        "UCX_MM_ERROR_HANDLING": "y",
        # ucxx sets UCX_MEMTYPE_CACHE at import, which UCX 1.21 warns about.
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        # A restarted worker can bind its fixed data port again right away.
        "UCX_TCP_CM_REUSEADDR": "y",
        # If anything initialises ucxx implicitly, make it use the same mode as acquire().
        "UCXPY_PROGRESS_MODE": "thread",
        "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    }


def apply_ucx_env_defaults(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """``env.setdefault`` every entry of :func:`ucx_env_defaults` (``os.environ`` by default)."""
    target = os.environ if env is None else env
    for key, value in ucx_env_defaults().items():
        target.setdefault(key, value)
    return target


def _ucxx():
    import ucxx  # deferred: importing ucxx sets UCX variables in os.environ

    return ucxx


def _ctx_exists() -> bool:
    from ucxx import core

    return core._ctx is not None  # ucxx has no public "is initialised" query


def acquire() -> None:
    """Initialise ucxx for this process if needed (idempotent, reference counted).

    Must be called from a coroutine running in the event loop that will drive transfers.
    """
    global _refs, _owner, _loop
    loop = asyncio.get_running_loop()  # raises RuntimeError outside a running loop
    with _lock:
        apply_ucx_env_defaults()
        ucxx = _ucxx()
        if _refs > 0:
            if loop is not _loop:
                raise RuntimeError(
                    "UCX is already in use by another event loop in this process; run all KV senders and "
                    "receivers of a process on one event loop"
                )
            _refs += 1
            return
        if _ctx_exists():
            if _owner and _loop is not None and _loop is not loop:
                # We initialised it for a previous (now unused) loop: its notifier thread is bound to that
                # loop, so start over on this one.
                _reset_locked()
            elif not _owner:
                logger.info("ucxx already initialised by someone else; using it as is")
        if not _ctx_exists():
            ucxx.init(progress_mode="thread", enable_python_future=True)
            _owner = True
            _install_exit_hook()
        _loop = loop
        _refs = 1


def release() -> None:
    """Drop one reference; the last one stops the notifier thread and resets UCX (if we initialised it)."""
    global _refs
    with _lock:
        if _refs <= 0:
            return
        _refs -= 1
        if _refs == 0 and _owner:
            _reset_locked()


def _stop_notifier() -> None:
    """``ucxx.stop_notifier_thread()``, but without waiting up to 1 s for the thread's next wake-up: the
    worker's request notifier is told to shut down first, so the thread exits at once."""
    from ucxx import core

    ctx = core._ctx
    running = ctx is not None and getattr(ctx, "notifier_thread", None) is not None
    if running:
        _signal_notifier(ctx)
    core.stop_notifier_thread()
    if running:
        # If the thread was between two waits, its last wait consumed the "stopping" state and marked the
        # notifier running again (the worker's destructor would then warn); mark it stopping for good.
        _signal_notifier(ctx)


def _signal_notifier(ctx) -> None:
    try:
        ctx.worker.stop_request_notifier_thread()
    except Exception:  # pragma: no cover - defensive
        logger.debug("stop_request_notifier_thread failed", exc_info=True)


def _reset_locked() -> None:
    global _owner, _loop
    ucxx = _ucxx()
    try:
        _stop_notifier()
    except Exception:  # pragma: no cover - defensive
        logger.exception("ucxx.stop_notifier_thread failed")
    try:
        ucxx.reset()
    except Exception as exc:  # an object still references the context; it is dropped anyway
        logger.debug("ucxx.reset: %s", exc)
    _owner = False
    _loop = None


def _exit_hook() -> None:
    # Runs before the interpreter joins non-daemon threads (the ucxx notifier thread is one).
    if _owner:
        try:
            _stop_notifier()
        except Exception:  # pragma: no cover - defensive
            pass


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_exit_hook)
        except RuntimeError:  # interpreter already shutting down
            pass
    _exit_hook_installed = True


def transports() -> frozenset[str]:
    """Names of the UCX transports this process's context has (``tcp``, ``sysv``, ``cuda_copy``, ...), from
    ``UCXContext.info``. Call after :func:`acquire`; an empty set when UCX does not describe them."""
    from ucxx import core

    from splitserve.transfer.paths import ucx_transports

    try:
        return ucx_transports(core._get_ctx().context.info)
    except Exception:  # pragma: no cover - defensive: a ucxx without .info
        logger.warning("could not read the UCX transports; assuming no CUDA transport", exc_info=True)
        return frozenset()
