"""Real-time settings for the loop's thread: CPU pinning, locked memory, SCHED_FIFO.

``closedloop run --rt`` and ``SessionConfig(rt=True)`` run the loop inside ``realtime(cfg)``: the calling
thread is pinned to one CPU (``os.sched_setaffinity(0, {cpu})``), the process's memory is locked
(``mlockall(MCL_CURRENT | MCL_FUTURE)``, so no page of the loop is ever swapped out or faulted in late) and the
thread runs under ``SCHED_FIFO`` at the given priority (``os.sched_setscheduler(0, ...)``: on Linux pid 0 is the
calling thread, not the whole process, so the observers' and monitor's threads started before keep their normal
policy). The loop itself freezes the garbage collector (``LoopConfig.freeze_gc``). Every part is asked of the
kernel for real; a part it refuses ends the set-up with a ``RealtimeError`` that names the part, the kernel's
answer and what to do, and whatever was already applied is undone. On leaving, the previous affinity, policy and
priority come back and memory is unlocked. The grant records what was asked and what the kernel reports it
granted (read back with ``os.sched_getscheduler``, ``os.sched_getparam`` and ``os.sched_getaffinity``), for the
session summary and the recording. It sits in ``runtime/`` (no torch); ``runtime.doctor`` checks the same rights
without keeping them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

MCL_CURRENT, MCL_FUTURE = 1, 2  # <sys/mman.h> on Linux (x86-64 and aarch64 alike)

# Above the kernel's threaded interrupt handlers (priority 50 on PREEMPT_RT) would starve a serial port's interrupt
# thread only while the loop runs; the loop sleeps most of each period, so the handlers run then.
DEFAULT_PRIORITY = 80

_PERMISSION_FIX = ("run as root, or give the interpreter the capabilities: sudo setcap cap_sys_nice,cap_ipc_lock+ep "
                   "{python}, or in a systemd unit LimitRTPRIO={priority} and LimitMEMLOCK=infinity "
                   "(docs/realtime.md)")


class RealtimeError(OSError):
    """A real-time setting the kernel refused; ``part`` is ``cpu``, ``memory_lock`` or ``scheduler``."""

    def __init__(self, part: str, message: str, err: int | None = None):
        super().__init__(err or errno.EPERM, message)
        self.part = part

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass
class RealtimeConfig:
    """What to ask for: SCHED_FIFO at ``priority``, pinned to ``cpu`` (None: leave the affinity), memory locked."""

    priority: int = DEFAULT_PRIORITY
    cpu: int | None = None
    lock_memory: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"policy": "SCHED_FIFO", "priority": self.priority, "cpu": self.cpu, "lock_memory": self.lock_memory}


@dataclass
class RealtimeGrant:
    """What the kernel granted the loop's thread, as it reports it; ``restore()`` puts the old settings back."""

    asked: dict[str, Any]
    policy: str  # as os.sched_getscheduler reports it: SCHED_FIFO, SCHED_OTHER, ...
    priority: int
    cpus: list[int]  # the thread's affinity after pinning
    memory_locked: bool
    thread_id: int  # the kernel's id of the thread that got the settings (threading.get_native_id)
    gc_frozen: bool = False  # set by the caller: whether its loop freezes the collector (LoopConfig.freeze_gc)
    #: set by the caller: what a local device emulator got (``emulator_realtime``); empty for a real device
    emulator: dict[str, Any] = field(default_factory=dict)
    _saved: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"asked": self.asked, "granted": {"policy": self.policy, "priority": self.priority, "cpus": self.cpus,
                                                 "memory_locked": self.memory_locked, "gc_frozen": self.gc_frozen,
                                                 "thread_id": self.thread_id}} | (
            {"emulator": self.emulator} if self.emulator else {})

    def format(self) -> str:
        return format_grant(self.to_dict())

    def restore(self) -> None:
        """Put back the policy, priority and affinity the thread had, and unlock memory (idempotent)."""
        saved, self._saved = self._saved, {}
        if not saved:
            return
        if "policy" in saved:
            os.sched_setscheduler(0, saved["policy"], os.sched_param(saved["priority"]))
        if "cpus" in saved:
            os.sched_setaffinity(0, saved["cpus"])
        if saved.get("locked"):
            _libc().munlockall()


def format_grant(grant: dict[str, Any]) -> str:
    """One line from ``RealtimeGrant.to_dict()`` (also as a session summary or a recording keeps it)."""
    g = grant["granted"]
    text = (f"real time: {g['policy']} priority {g['priority']} on CPU {','.join(map(str, g['cpus']))}, memory "
            f"{'locked' if g['memory_locked'] else 'not locked'}, gc {'frozen' if g['gc_frozen'] else 'running'}")
    emu = grant.get("emulator") or {}
    if emu.get("refused"):
        text += f"; the device emulator (pid {emu['pid']}) kept its scheduling: {emu['refused']}"
    elif emu:
        text += (f"; the device emulator (pid {emu['pid']}) {emu['policy']} priority {emu['priority']} on CPU "
                 + ",".join(map(str, emu["cpus"])))
        if set(emu["cpus"]) & set(g["cpus"]):
            text += " (the loop's too: the process may use no other CPU, as under a unit's CPUAffinity=)"
    return text


def policy_name(policy: int) -> str:
    names = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_FIFO", "SCHED_RR", "SCHED_BATCH", "SCHED_IDLE")
             if hasattr(os, n)}
    return names.get(policy, f"policy {policy}")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _limit(which: int) -> str:
    soft, _ = resource.getrlimit(which)
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{soft // 1024} KiB" if which == resource.RLIMIT_MEMLOCK else str(soft)


def apply_realtime(cfg: RealtimeConfig) -> RealtimeGrant:
    """Apply ``cfg`` to the calling thread and return the grant; on a refusal undo and raise ``RealtimeError``."""
    if not hasattr(os, "sched_setscheduler"):
        raise RealtimeError("scheduler", f"--rt needs Linux: this is {sys.platform}, which has no SCHED_FIFO for a "
                                         "thread; run without --rt")
    fix = _PERMISSION_FIX.format(python=os.path.realpath(sys.executable), priority=cfg.priority)
    saved: dict[str, Any] = {}
    grant = RealtimeGrant(asked=cfg.to_dict(), policy="", priority=0, cpus=[], memory_locked=False,
                          thread_id=threading.get_native_id(), _saved=saved)
    try:
        if cfg.cpu is not None:
            allowed = os.sched_getaffinity(0)
            try:
                os.sched_setaffinity(0, {cfg.cpu})
            except (OSError, ValueError, OverflowError) as exc:
                raise RealtimeError("cpu", f"--rt: pinning the loop to CPU {cfg.cpu} was refused ({exc}): this "
                                           f"process may run on CPUs {_ranges(allowed)}; give --cpu one of them",
                                    errno.EINVAL) from None
            saved["cpus"] = allowed
        if cfg.lock_memory:
            libc = _libc()
            if libc.mlockall(MCL_CURRENT | MCL_FUTURE) != 0:
                err = ctypes.get_errno()
                raise RealtimeError("memory_lock", f"--rt: locking memory (mlockall) was refused: "
                                                   f"{os.strerror(err)}; RLIMIT_MEMLOCK here is "
                                                   f"{_limit(resource.RLIMIT_MEMLOCK)}: {fix}", err)
            saved["locked"] = True
        old_policy, old_param = os.sched_getscheduler(0), os.sched_getparam(0)
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(cfg.priority))
        except PermissionError as exc:
            raise RealtimeError("scheduler", f"--rt: SCHED_FIFO at priority {cfg.priority} was refused ({exc.strerror}); "
                                             f"RLIMIT_RTPRIO here is {_limit(resource.RLIMIT_RTPRIO)}: {fix}",
                                exc.errno) from None
        except (OSError, OverflowError) as exc:
            lo, hi = os.sched_get_priority_min(os.SCHED_FIFO), os.sched_get_priority_max(os.SCHED_FIFO)
            raise RealtimeError("scheduler", f"--rt: SCHED_FIFO at priority {cfg.priority} was refused ({exc}): "
                                             f"SCHED_FIFO priorities here are {lo} to {hi}; give --priority in that "
                                             "range", errno.EINVAL) from None
        saved["policy"], saved["priority"] = old_policy, old_param.sched_priority
    except BaseException:
        grant.restore()
        raise
    grant.policy = policy_name(os.sched_getscheduler(0))
    grant.priority = os.sched_getparam(0).sched_priority
    grant.cpus = sorted(os.sched_getaffinity(0))
    grant.memory_locked = bool(saved.get("locked"))
    return grant


@contextmanager
def realtime(cfg: RealtimeConfig) -> Iterator[RealtimeGrant]:
    """``with realtime(cfg) as grant:`` the loop runs with the settings; they are restored on the way out."""
    grant = apply_realtime(cfg)
    try:
        yield grant
    finally:
        grant.restore()


#: SCHED_FIFO priority of a local device emulator under --rt: above every normal task, far under the loop's
EMULATOR_PRIORITY = 1


def _threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return [pid]


@contextmanager
def emulator_realtime(pid: int | None, loop_cpu: int | None,
                      priority: int = EMULATOR_PRIORITY) -> Iterator[dict[str, Any]]:
    """Run a device emulator started on this machine (``sim://``) as a device's own clock runs, for the loop only.

    A hardware device keeps its rate whatever the host does; an emulator is a process at normal priority, so a
    monitor's server, a browser or a compile on the same CPUs delays its frames, they arrive bunched, and the loop
    pays for it as catching-up steps. Under ``--rt`` each of the emulator's threads gets ``SCHED_FIFO`` at
    ``priority`` (above every normal task, far under the loop's) and, where the machine has another CPU, the CPUs
    other than the loop's. Yields what was granted (``pid``, ``policy``, ``priority``, ``cpus``) or, where the
    kernel refused, ``refused`` with its answer: the emulator then runs as it was, and the session goes on. The
    old settings come back on leaving."""
    if pid is None or not hasattr(os, "sched_setscheduler"):
        yield {}
        return
    saved: list[tuple[int, int, int, set[int]]] = []
    info: dict[str, Any] = {"pid": pid}
    try:
        for tid in _threads(pid):
            try:
                old = (tid, os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority, os.sched_getaffinity(tid))
                others = old[3] - {loop_cpu} if loop_cpu is not None else old[3]
                if others and others != old[3]:
                    os.sched_setaffinity(tid, others)
                saved.append(old)
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(priority))
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
        info |= {"policy": policy_name(os.sched_getscheduler(pid)), "priority": os.sched_getparam(pid).sched_priority,
                 "cpus": sorted(os.sched_getaffinity(pid))}
    except (OSError, OverflowError) as exc:
        info["refused"] = f"{type(exc).__name__}: {exc}"
        _restore(saved)  # all or nothing: the threads already changed go back now
        saved = []
    try:
        yield info
    finally:
        _restore(saved)


def _restore(saved: list[tuple[int, int, int, set[int]]]) -> None:
    for tid, policy, prio, cpus in saved:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(prio))
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the emulator ended first


def _ranges(cpus: set[int]) -> str:
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
