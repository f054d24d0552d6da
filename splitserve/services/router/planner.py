"""The planner's decisions: which P:D split the load calls for, and when to flip one worker's role.

Each tick (:meth:`PlannerCore.decide`) turns the router's :class:`~.planner_signals.Signals` into a *load* per kind
of work, a ratio where 1.0 is the target:

* prefill load = max(TTFT quantile / ``slo_ttft_ms``, queued prefill tokens per prefill worker /
  ``queued_tokens_per_worker``);
* decode load = max(ITL quantile / ``slo_itl_ms``, running decodes per decode worker / ``running_per_worker``).

It *wants* one more worker for the more loaded kind of work (the target) when that load is above 1.0, the other
kind (the source) has at least two workers, and taking one of them keeps the source's projected load
(``load * n / (n - 1)``) at least ``margin`` times below the target's: the flip lowers the worst load, and the
reverse flip is not wanted right after it. A role with no worker at all is wanted at once (if the other can spare
one). Hysteresis, so that it never flaps:

* a want must hold on every tick for ``window_s`` (a signal that oscillates faster never flips anything);
* after a flip nothing is flipped for ``cooldown_s`` (the new worker's effect reaches the latency window first);
* only a worker whose role can change, that is up, takes exactly the source role and is not draining an earlier
  switch is flipped (the least loaded one); a role is never left without a worker.

Every flip is checked once its cool-down is over: if the worst of the two loads then is more than
``revert_tolerance`` times what it was at the flip, the flip made things worse and is undone (the same worker flips
back; action "revert"), and another worker for that kind of work is not wanted for ``4 * cooldown_s``, doubled at
each further failed flip of that kind and reset by a kept one (action "backoff" while it lasts). A worker of one
kind does not always add capacity: when the workers share CPU cores (several on one machine), one more decode worker
splits the batch that one worker ran in one step into two, each stepping separately on the same cores
(benchmarks/results/planner_shift.md: the ITL rose after such a flip, and the unchecked planner kept it).

``desired`` is the replica count per role an autoscaler (HPA, KEDA) could act on: max(1, ceil(n * load)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from splitserve.services.worker.roles import DECODE, PREFILL, takes

OTHER = {PREFILL: DECODE, DECODE: PREFILL}


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The planner's knobs (router flags ``--planner``, ``--slo-ttft-ms``, ``--slo-itl-ms``, ``--planner-*``).

    slo_ttft_ms, slo_itl_ms: latency targets (ms) of the ``quantile`` (0..1) of TTFT and ITL; None: not a signal.
    queued_tokens_per_worker: queued prefill tokens one prefill worker may have before prefill counts as loaded.
    running_per_worker: running decodes one decode worker may have before decode counts as loaded.
    window_s: seconds a want must hold before a flip (also the latency quantiles' window).
    cooldown_s: seconds after a flip during which nothing is flipped.
    interval_s: seconds between ticks.
    margin: how far (a ratio > 1) below the target's load the source's projected load must stay.
    revert_tolerance: a flip is undone when, one cool-down after it, the worst load exceeds this many times the worst
        load at the flip (>= 1).

    Raises:
        ValueError: a value out of range (the message names the flag).
    """

    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    queued_tokens_per_worker: float = 4096.0
    running_per_worker: float = 48.0
    window_s: float = 10.0
    cooldown_s: float = 30.0
    interval_s: float = 1.0
    quantile: float = 0.9
    margin: float = 1.2
    revert_tolerance: float = 1.1

    def __post_init__(self) -> None:
        for flag, value in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-itl-ms", self.slo_itl_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0 (unset: not a signal), got {value}")
        for flag, value in (("--planner-queued-tokens", self.queued_tokens_per_worker),
                            ("--planner-running-decodes", self.running_per_worker), ("--planner-interval-s", self.interval_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        if not (self.window_s >= 0 and self.cooldown_s >= 0):
            raise ValueError(f"--planner-window-s and --planner-cooldown-s must be >= 0, got {self.window_s}, {self.cooldown_s}")
        if not 0 < self.quantile < 1 or not self.margin >= 1 or not self.revert_tolerance >= 1:
            raise ValueError(f"planner quantile must be in (0, 1), margin and revert tolerance >= 1, got {self.quantile}, "
                             f"{self.margin}, {self.revert_tolerance}")


@dataclass(frozen=True, slots=True)
class PoolWorker:
    """One worker as the planner sees it. ``role``: its current role (a worker born to one role: that role)."""

    address: str
    role: str
    elastic: bool  # its role can change (pd.v1.RoleService)
    up: bool = True
    draining: bool = False  # still draining the role it left at an earlier switch
    load: float = 0.0  # work of its current role (queued prefill tokens or running decodes): the least loaded flips


@dataclass(frozen=True, slots=True)
class Decision:
    """One tick's outcome. ``action``: "hold" (nothing wanted), "wait" (a want holding, window not over),
    "cooldown", "backoff" (the want's kind of work had a flip undone lately), "no_candidate" (no worker can be flipped),
    "flip" (``address`` from ``from_role`` to ``to_role``) or "revert" (a flip that made the worst load worse, undone:
    ``address`` back from ``from_role`` to ``to_role``)."""

    time: float
    action: str
    want: str | None = None  # the kind of work that wants one more worker
    reason: str = ""
    loads: dict[str, float] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)  # workers that take each kind of work, up
    desired: dict[str, int] = field(default_factory=dict)
    address: str | None = None
    from_role: str | None = None
    to_role: str | None = None

    def describe(self, origin: float = 0.0) -> dict:
        """JSON-ready; ``time_s`` counts from ``origin`` (monotonic seconds)."""
        return {"time_s": round(self.time - origin, 3), "action": self.action, "want": self.want, "reason": self.reason,
                "loads": {k: round(v, 3) for k, v in self.loads.items()}, "workers": self.workers,
                "desired_workers": self.desired, "worker": self.address, "from_role": self.from_role, "to_role": self.to_role}


class PlannerCore:
    """The decision logic of the module docstring, without I/O. ``clock``: monotonic seconds (injectable)."""

    def __init__(self, config: PlannerConfig, clock: Callable[[], float]) -> None:
        self.config, self.clock = config, clock
        self._want: str | None = None
        self._since = 0.0  # when the current want began
        self._last_flip = -math.inf
        self._unchecked: Decision | None = None  # the last flip, until its effect is checked (end of its cool-down)
        self._backoff_until = {PREFILL: -math.inf, DECODE: -math.inf}  # per kind of work wanted
        self._backoff_s = {PREFILL: self._first_backoff_s, DECODE: self._first_backoff_s}

    @property
    def _first_backoff_s(self) -> float:
        return 4 * self.config.cooldown_s

    def loads(self, signals, workers: dict[str, int]) -> tuple[dict[str, float], dict[str, str]]:
        """(load per kind of work, what set it) for ``signals`` (a :class:`~.planner_signals.Signals`)."""
        c = self.config
        parts = {PREFILL: [(signals.queued_prefill_tokens / (max(workers[PREFILL], 1) * c.queued_tokens_per_worker),
                            f"queued prefill tokens {signals.queued_prefill_tokens:.0f} on {workers[PREFILL]} worker(s), "
                            f"target {c.queued_tokens_per_worker:.0f} each")],
                 DECODE: [(signals.running_decodes / (max(workers[DECODE], 1) * c.running_per_worker),
                           f"running decodes {signals.running_decodes:.0f} on {workers[DECODE]} worker(s), "
                           f"target {c.running_per_worker:.0f} each")]}
        q = round(c.quantile * 100)
        if c.slo_ttft_ms is not None and signals.ttft_s is not None:
            parts[PREFILL].append((signals.ttft_s * 1000 / c.slo_ttft_ms,
                                   f"TTFT p{q} {signals.ttft_s * 1000:.0f} ms, SLO {c.slo_ttft_ms:g} ms"))
        if c.slo_itl_ms is not None and signals.itl_s is not None:
            parts[DECODE].append((signals.itl_s * 1000 / c.slo_itl_ms,
                                  f"ITL p{q} {signals.itl_s * 1000:.1f} ms, SLO {c.slo_itl_ms:g} ms"))
        worst = {role: max(p, key=lambda x: x[0]) for role, p in parts.items()}
        return {role: w[0] for role, w in worst.items()}, {role: w[1] for role, w in worst.items()}

    def _wanted(self, loads: dict[str, float], why: dict[str, str], workers: dict[str, int]) -> tuple[str | None, str]:
        target = PREFILL if loads[PREFILL] >= loads[DECODE] else DECODE
        for role in (target, OTHER[target]):  # an empty role first
            if workers[role] == 0 and workers[OTHER[role]] >= 2:
                return role, f"no worker takes {role} work"
        source = OTHER[target]
        n = workers[source]
        if loads[target] <= 1.0 or n < 2:
            return None, ""
        projected = loads[source] * n / (n - 1)
        if projected * self.config.margin > loads[target]:
            return None, ""
        return target, f"{target} load {loads[target]:.2f} ({why[target]}); {source} load {loads[source]:.2f} -> {projected:.2f} with one worker less"

    def decide(self, signals, pool: list[PoolWorker]) -> Decision:
        """This tick's decision for ``signals`` and the workers ``pool``; a "flip" is taken as done (cool-down)."""
        now, c = self.clock(), self.config
        workers = {work: sum(1 for w in pool if w.up and takes(w.role, work)) for work in (PREFILL, DECODE)}
        loads, why = self.loads(signals, workers)
        desired = {work: max(1, math.ceil(max(workers[work], 1) * loads[work] - 1e-9)) for work in (PREFILL, DECODE)}
        want, reason = self._wanted(loads, why, workers)
        if want != self._want:
            self._want, self._since = want, now
        base = dict(time=now, want=want, reason=reason, loads=loads, workers=workers, desired=desired)
        if self._unchecked is not None and now - self._last_flip >= c.cooldown_s:
            revert = self._check_last_flip(loads, pool, base)
            if revert is not None:
                return revert
        if want is None:
            return Decision(action="hold", **base)
        if now - self._last_flip < c.cooldown_s:
            return Decision(action="cooldown", **base)
        if now < self._backoff_until[want]:
            return Decision(action="backoff", **base)
        if now - self._since < c.window_s:
            return Decision(action="wait", **base)
        source = OTHER[want]
        candidates = [w for w in pool if _can_flip(w, source)]
        if not candidates or workers[source] < 2:
            return Decision(action="no_candidate", **base)
        pick = min(candidates, key=lambda w: (w.load, w.address))
        self._last_flip = self._since = now
        self._unchecked = Decision(action="flip", address=pick.address, from_role=source, to_role=want, **base)
        return self._unchecked

    def _check_last_flip(self, loads: dict[str, float], pool: list[PoolWorker], base: dict) -> Decision | None:
        """The last flip's check (module docstring): a "revert" decision if it made the worst load worse and its worker
        can flip back, else None (the flip is kept, or cannot be undone)."""
        flip, now = self._unchecked, base["time"]
        self._unchecked = None
        before, after = max(flip.loads.values()), max(loads.values())
        role = flip.to_role
        if after <= before * self.config.revert_tolerance:
            self._backoff_s[role] = self._first_backoff_s
            return None
        self._backoff_until[role] = now + self._backoff_s[role]
        self._backoff_s[role] *= 2
        worker = next((w for w in pool if w.address == flip.address), None)
        if worker is None or not _can_flip(worker, role):
            return None
        self._last_flip = self._since = now
        reason = (f"undo the flip of {flip.address} to {role} {now - flip.time:.0f} s ago: the worst load went "
                  f"{before:.2f} -> {after:.2f}; no {role} flip for {self._backoff_until[role] - now:.0f} s")
        return Decision(action="revert", **{**base, "reason": reason}, address=flip.address, from_role=role,
                        to_role=flip.from_role)



def _can_flip(w: PoolWorker, role: str) -> bool:
    """``w`` can leave ``role`` now: its role can change, it is up, has exactly that role and is not draining."""
    return w.elastic and w.up and w.role == role and not w.draining


def add_planner_args(ap) -> None:
    """The router's planner flags (``argparse.ArgumentParser``), with PD_* environment defaults."""
    from splitserve.env import env_bool, env_float

    d = PlannerConfig()
    ap.add_argument("--planner", action="store_true", default=env_bool("PD_PLANNER"),
                    help="flip workers whose role can change (--workers) between prefill and decode as the load asks (PD_PLANNER)")
    ap.add_argument("--slo-ttft-ms", type=float, default=env_float("PD_SLO_TTFT_MS", None),
                    help="planner: TTFT target of the p90, ms (PD_SLO_TTFT_MS; unset: TTFT is not a signal)")
    ap.add_argument("--slo-itl-ms", type=float, default=env_float("PD_SLO_ITL_MS", None),
                    help="planner: ITL target of the p90, ms (PD_SLO_ITL_MS; unset: ITL is not a signal)")
    ap.add_argument("--planner-queued-tokens", type=float, default=env_float("PD_PLANNER_QUEUED_TOKENS", d.queued_tokens_per_worker),
                    help="planner: queued prefill tokens per prefill worker at which prefill counts as fully loaded")
    ap.add_argument("--planner-running-decodes", type=float, default=env_float("PD_PLANNER_RUNNING_DECODES", d.running_per_worker),
                    help="planner: running decodes per decode worker at which decode counts as fully loaded")
    ap.add_argument("--planner-window-s", type=float, default=env_float("PD_PLANNER_WINDOW_S", d.window_s),
                    help="planner: seconds a want must hold before a flip; also the latency quantiles' window")
    ap.add_argument("--planner-cooldown-s", type=float, default=env_float("PD_PLANNER_COOLDOWN_S", d.cooldown_s),
                    help="planner: seconds after a flip during which no worker is flipped")
    ap.add_argument("--planner-interval-s", type=float, default=env_float("PD_PLANNER_INTERVAL_S", d.interval_s),
                    help="planner: seconds between two decisions")


def planner_config(a) -> PlannerConfig | None:
    """The :class:`PlannerConfig` of parsed flags (:func:`add_planner_args`); None without ``--planner``.
    Raises ValueError for a value out of range."""
    if not a.planner:
        return None
    return PlannerConfig(slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms, queued_tokens_per_worker=a.planner_queued_tokens,
                         running_per_worker=a.planner_running_decodes, window_s=a.planner_window_s,
                         cooldown_s=a.planner_cooldown_s, interval_s=a.planner_interval_s)
