"""Is this machine ready for a real-time session? ``closedloop doctor``'s checks.

Each check is a function registered with ``@check(name, title)`` that looks at one thing (the CPU governor, the
right to SCHED_FIFO, the serial ports, a short run of the loop) and returns a ``CheckResult``: ``pass``, ``warn``
or ``fail``, what it found, and what to do about it (the command or setting). Rights are tried for real, never
inferred from the user id: SCHED_FIFO on a throwaway thread, ``mlockall`` in a child process. Every path is read
under ``DoctorConfig.root`` (``/`` on a real machine; a test points it at an empty folder), and a check that cannot
read what it needs (a container without ``/sys``, macOS) says ``warn: cannot tell (why)``: a check that raises is
reported that way too, so one odd machine never stops the report. The layer is ``runtime/`` (no torch); what
each check means and how to fix it is in docs/realtime.md.
"""

from __future__ import annotations

import glob
import grp
import importlib
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class DoctorConfig:
    root: str = "/"  # where /sys, /proc and /dev are read (tests: a folder without them)
    jitter_s: float = 2.0  # the loop-jitter probe's length
    jitter_rate_hz: float = 1000.0
    only: list[str] | None = None  # run these checks only (names as in CHECKS)

    def path(self, p: str) -> Path:
        return Path(self.root) / p.lstrip("/")


@dataclass
class CheckResult:
    name: str
    title: str
    status: str  # pass, warn or fail
    message: str  # what was found
    fix: str = ""  # what to do (a command or a setting); empty when nothing needs doing
    data: dict[str, Any] = field(default_factory=dict)  # the numbers behind the message


@dataclass
class DoctorReport:
    checks: list[CheckResult]

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, WARN, FAIL)}
        return {"ok": not self.failed, "counts": counts, "machine": _machine(),
                "checks": [asdict(c) for c in self.checks]}

    def format(self) -> str:
        lines = []
        for c in self.checks:
            lines.append(f"{c.status:<4}  {c.title}: {c.message}")
            if c.fix:
                lines.append(f"      fix: {c.fix}")
        counts = self.to_dict()["counts"]
        lines.append(f"{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail")
        return "\n".join(lines)


CheckFn = Callable[[DoctorConfig], CheckResult]
CHECKS: dict[str, tuple[str, CheckFn]] = {}


def check(name: str, title: str) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        CHECKS[name] = (title, fn)
        return fn

    return deco


def run_doctor(cfg: DoctorConfig | None = None) -> DoctorReport:
    """Run every registered check (or ``cfg.only``); a check that raises is a warn, never a crash."""
    cfg = cfg or DoctorConfig()
    unknown = [n for n in cfg.only or [] if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown doctor check(s) {', '.join(unknown)}: expected one of {', '.join(CHECKS)}")
    results = []
    for name, (title, fn) in CHECKS.items():
        if cfg.only and name not in cfg.only:
            continue
        try:
            r = fn(cfg)
        except Exception as exc:  # noqa: BLE001  (one odd machine must not stop the report)
            r = _r(WARN, f"cannot tell ({type(exc).__name__}: {exc})")
        r.name, r.title = name, title
        results.append(r)
    return DoctorReport(results)


def _r(status: str, message: str, fix: str = "", /, **data: Any) -> CheckResult:
    return CheckResult("", "", status, message, fix, data)


def _read(cfg: DoctorConfig, path: str) -> str | None:
    try:
        return cfg.path(path).read_text().strip()
    except OSError:
        return None


def _machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "uid": os.getuid() if hasattr(os, "getuid") else None}


# --- CPU and kernel ---------------------------------------------------------------------------------------------

@check("cpu_governor", "CPU frequency governor")
def _governor(cfg: DoctorConfig) -> CheckResult:
    files = sorted(glob.glob(str(cfg.path("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor"))))
    if not files:
        return _r(WARN, "cannot tell (no /sys/devices/system/cpu/cpu*/cpufreq: a VM or container without "
                        "frequency scaling, or not Linux)")
    govs = {Path(f).parts[-3]: Path(f).read_text().strip() for f in files}
    slow = {c: g for c, g in govs.items() if g != "performance"}
    if not slow:
        return _r(PASS, f"performance on {len(govs)} CPUs", governors=govs)
    return _r(WARN, f"{', '.join(f'{c} {g}' for c, g in slow.items())}: a CPU that clocks down between steps takes "
                    "tens of microseconds to clock up again",
              "sudo cpupower frequency-set -g performance (Jetson: sudo jetson_clocks)", governors=govs)


@check("isolated_cpus", "isolated CPUs")
def _isolated(cfg: DoctorConfig) -> CheckResult:
    text = _read(cfg, "/sys/devices/system/cpu/isolated")
    if text is None:
        return _r(WARN, "cannot tell (no /sys/devices/system/cpu/isolated)")
    fix = ("add isolcpus=N nohz_full=N rcu_nocbs=N to the kernel command line (N: the loop's CPU, not CPU 0), "
           "then closedloop run --rt --cpu N")
    if not text:
        return _r(WARN, "none: the loop's CPU is shared with every other task and interrupt", fix)
    return _r(PASS, f"{text} (give the loop one: closedloop run --rt --cpu N)", isolated=text)


@check("preempt_rt", "PREEMPT_RT kernel")
def _preempt(cfg: DoctorConfig) -> CheckResult:
    flag = _read(cfg, "/sys/kernel/realtime")
    version = platform.version() if cfg.root == "/" else ""
    if flag == "1" or "PREEMPT_RT" in version:
        return _r(PASS, f"a fully preemptible kernel ({platform.release()})")
    if sys.platform != "linux":
        return _r(WARN, f"cannot tell ({sys.platform} is not Linux)")
    fix = ("a PREEMPT_RT kernel (Debian/Ubuntu: the linux-image-rt package; JetPack: the real-time kernel "
           "packages); without it kernel sections can delay the loop by hundreds of microseconds")
    if flag is None and not version:
        return _r(WARN, "cannot tell (no /sys/kernel/realtime and no kernel version string)", fix)
    kind = "PREEMPT_DYNAMIC" if "PREEMPT_DYNAMIC" in version else "PREEMPT" if "PREEMPT" in version else "no preemption"
    return _r(WARN, f"not PREEMPT_RT ({kind}: {version})", fix)


# --- rights -----------------------------------------------------------------------------------------------------

@check("sched_fifo", "permission for SCHED_FIFO")
def _sched_fifo(cfg: DoctorConfig) -> CheckResult:
    if not hasattr(os, "sched_setscheduler"):
        return _r(WARN, f"cannot tell ({sys.platform} has no SCHED_FIFO per thread)")
    result: dict[str, Any] = {}

    def probe() -> None:  # its own thread: pid 0 is this thread on Linux, so the caller's policy is untouched
        try:
            prio = os.sched_get_priority_max(os.SCHED_FIFO)
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(prio))
            result["granted"] = os.sched_getscheduler(0) == os.SCHED_FIFO
            result["priority"] = os.sched_getparam(0).sched_priority
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:
            result["error"] = exc.strerror

    t = threading.Thread(target=probe, name="doctor-sched-fifo")
    t.start()
    t.join()
    rtprio = resource.getrlimit(resource.RLIMIT_RTPRIO)[0]
    runtime_us = _read(cfg, "/proc/sys/kernel/sched_rt_runtime_us")
    data = {"rlimit_rtprio": "unlimited" if rtprio == resource.RLIM_INFINITY else rtprio,
            "sched_rt_runtime_us": runtime_us}
    if result.get("granted"):
        note = (f"; real-time tasks may use {int(runtime_us) / 1e4:g}% of each second (sched_rt_runtime_us): one that "
                "never sleeps is stopped for the rest of the second" if runtime_us and runtime_us != "-1" else "")
        return _r(PASS, f"granted (tried at priority {result['priority']} and restored){note}", **data)
    return _r(FAIL, f"refused ({result.get('error', 'not granted')}); RLIMIT_RTPRIO is {data['rlimit_rtprio']}",
              f"run as root, or sudo setcap cap_sys_nice+ep {os.path.realpath(sys.executable)}, or LimitRTPRIO=99 "
              "in the service's systemd unit (or an rtprio line in /etc/security/limits.conf)", **data)


_MLOCK_PROBE = ("import ctypes, ctypes.util, os, sys\n"
                "libc = ctypes.CDLL(ctypes.util.find_library('c') or None, use_errno=True)\n"
                "ok = libc.mlockall(3) == 0\n"
                "sys.stdout.write('ok' if ok else os.strerror(ctypes.get_errno()))\n")


@check("mlockall", "permission to lock memory (mlockall)")
def _mlockall(cfg: DoctorConfig) -> CheckResult:
    if not sys.platform.startswith("linux"):
        return _r(WARN, f"cannot tell (mlockall is tried on Linux only; this is {sys.platform})")
    # a child process: locking this one would pin every page it has, and MCL_FUTURE every page it maps later
    out = subprocess.run([sys.executable, "-I", "-c", _MLOCK_PROBE], capture_output=True, text=True, timeout=30)
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    if out.stdout == "ok":
        why = "; root, whose CAP_IPC_LOCK lifts that limit" if os.geteuid() == 0 and limit != "unlimited" else ""
        return _r(PASS, f"granted (MCL_CURRENT|MCL_FUTURE in a child process; RLIMIT_MEMLOCK {limit}{why})",
                  rlimit_memlock=limit)
    return _r(FAIL, f"refused ({out.stdout or out.stderr.strip()[-200:]}); RLIMIT_MEMLOCK is {limit}, less than a "
                    "session's memory",
              f"run as root, or sudo setcap cap_ipc_lock+ep {os.path.realpath(sys.executable)}, or "
              "LimitMEMLOCK=infinity in the service's systemd unit (ulimit -l unlimited in a shell)",
              rlimit_memlock=limit)


@check("timer_slack", "timer slack")
def _timer_slack(cfg: DoctorConfig) -> CheckResult:
    text = _read(cfg, f"/proc/{os.getpid()}/timerslack_ns")
    if text is None:
        return _r(WARN, "cannot tell (no /proc/PID/timerslack_ns)")
    ns = int(text)
    if ns <= 1000:
        return _r(PASS, f"{ns} ns", timer_slack_ns=ns)
    return _r(WARN, f"{ns / 1000:g} us: the kernel may end the loop's sleeps that much late (the loop's spin "
                    "absorbs up to its spin_us)",
              "closedloop run --rt (a SCHED_FIFO thread has no timer slack), or prctl(PR_SET_TIMERSLACK, 1)",
              timer_slack_ns=ns)


@check("swap", "swap")
def _swap(cfg: DoctorConfig) -> CheckResult:
    text = _read(cfg, "/proc/swaps")
    if text is None:
        return _r(WARN, "cannot tell (no /proc/swaps)")
    devices = [line.split()[0] for line in text.splitlines()[1:] if line.strip()]
    if not devices:
        return _r(PASS, "off")
    return _r(WARN, f"on ({', '.join(devices)}): a page of the session swapped out stalls its loop for milliseconds",
              "closedloop run --rt locks the session's memory (mlockall); or sudo swapoff -a", swap=devices)


# --- serial -----------------------------------------------------------------------------------------------------

@check("serial_ports", "serial ports and group membership")
def _serial(cfg: DoctorConfig) -> CheckResult:
    ports = sorted(glob.glob(str(cfg.path("/dev/ttyUSB*"))) + glob.glob(str(cfg.path("/dev/ttyACM*"))))
    if not ports:
        if not cfg.path("/dev").is_dir():
            return _r(WARN, "cannot tell (no /dev)")
        return _r(WARN, "no /dev/ttyUSB* or /dev/ttyACM*: no USB board connected (sim:// devices need none)",
                  "connect the board; dmesg | tail shows the port it got")
    denied = {}
    for p in ports:
        if not os.access(p, os.R_OK | os.W_OK):
            try:
                denied[p] = grp.getgrgid(os.stat(p).st_gid).gr_name
            except (KeyError, OSError):
                denied[p] = "?"
    if not denied:
        return _r(PASS, f"{', '.join(ports)}, readable and writable", ports=ports)
    groups = sorted(set(denied.values()))
    return _r(FAIL, f"no read/write access to {', '.join(denied)} (group {', '.join(groups)})",
              f"sudo usermod -aG {groups[0]} $USER, then log in again (a systemd unit: SupplementaryGroups="
              f"{groups[0]})", ports=ports, denied=denied)


@check("usb_latency_timer", "USB-serial latency timers")
def _latency_timer(cfg: DoctorConfig) -> CheckResult:
    base = cfg.path("/sys/bus/usb-serial/devices")
    if not base.is_dir():
        return _r(WARN, "cannot tell (no /sys/bus/usb-serial/devices: no usbserial driver loaded, or not Linux); "
                        "CDC-ACM boards (/dev/ttyACM*) have no latency timer")
    timers = {}
    for dev in sorted(base.iterdir()):
        try:
            timers[dev.name] = int((dev / "latency_timer").read_text())
        except (OSError, ValueError):  # a CDC or other adapter without one
            continue
    if not timers:
        return _r(PASS, "no USB-serial adapter with a latency timer (FTDI-style) is connected")
    slow = {d: ms for d, ms in timers.items() if ms > 1}
    if not slow:
        return _r(PASS, ", ".join(f"{d} {ms} ms" for d, ms in timers.items()), latency_timer_ms=timers)
    d = next(iter(slow))
    return _r(WARN, f"{', '.join(f'{d} {ms} ms' for d, ms in slow.items())}: the adapter holds received bytes up to "
                    "that long before passing them on",
              f"echo 1 | sudo tee /sys/bus/usb-serial/devices/{d}/latency_timer (for good: a udev rule "
              'ACTION=="add", SUBSYSTEM=="usb-serial", DRIVER=="ftdi_sio", ATTR{latency_timer}="1")',
              latency_timer_ms=timers)


# --- inference stack --------------------------------------------------------------------------------------------

@check("onnxruntime", "ONNX Runtime providers")
def _ort(cfg: DoctorConfig) -> CheckResult:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return _r(FAIL, f"onnxruntime does not import ({exc})", "pip install onnxruntime (on a Jetson: the wheel "
                                                                 "for your JetPack, docs/install.md)")
    providers = ort.get_available_providers()
    have = {p: p in providers for p in ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider")}
    if not have["CPUExecutionProvider"]:
        return _r(FAIL, f"onnxruntime {ort.__version__} has no CPU provider ({providers})", "pip install onnxruntime",
                  providers=providers)
    gpu = [p.removesuffix("ExecutionProvider") for p in providers if p != "CPUExecutionProvider"]
    if not have["CUDAExecutionProvider"]:
        return _r(WARN, f"onnxruntime {ort.__version__}: CPU only ({', '.join(providers)}); no CUDA or TensorRT "
                        "provider", "on a GPU machine: pip install onnxruntime-gpu (Jetson: the JetPack build); "
                                    "a CPU board needs nothing", providers=providers)
    # A listed provider may still fail to load (a missing libcudnn): the ort-cuda / ort-trt backends' own probe says.
    from .backends.ort_gpu_backend import OrtCudaBackend, OrtTrtBackend

    backends = {cls.name: cls.availability() for cls in (OrtCudaBackend, OrtTrtBackend)
                if cls.provider in providers}
    broken = {n: a.reason for n, a in backends.items() if not a}
    if broken:
        return _r(WARN, f"onnxruntime {ort.__version__} lists {', '.join(gpu)}, but "
                        + "; ".join(f"backend {n} is unavailable: {r}" for n, r in broken.items()),
                  "install the CUDA and cuDNN libraries that this onnxruntime-gpu build needs (its release notes "
                  "name the versions) and check the driver with nvidia-smi", providers=providers, backends=broken)
    return _r(PASS, f"onnxruntime {ort.__version__}: CPU and {', '.join(gpu)} (backends "
                    f"{', '.join(backends) or 'none'} run)", providers=providers)


@check("tensorrt", "tensorrt and cuda-python")
def _tensorrt(cfg: DoctorConfig) -> CheckResult:
    found, missing = {}, []
    for name, modules in (("tensorrt", ("tensorrt",)), ("cuda-python", ("cuda.bindings.runtime", "cuda.cudart"))):
        for m in modules:
            try:
                mod = importlib.import_module(m)
                found[name] = getattr(mod, "__version__", "") or getattr(sys.modules[m.split('.')[0]], "__version__", "")
                break
            except ImportError as exc:
                last = str(exc)
        else:
            missing.append(f"{name} ({last})")
    if not missing:
        return _r(PASS, ", ".join(f"{k} {v}".strip() for k, v in found.items()), versions=found)
    return _r(WARN, f"not importable: {'; '.join(missing)}: the native tensorrt backend is unavailable (optional)",
              "on a GPU machine: pip install tensorrt cuda-python; JetPack ships tensorrt (a venv needs "
              "--system-site-packages to see it)", versions=found)


@check("numba_cache", "Numba cache writable")
def _numba_cache(cfg: DoctorConfig) -> CheckResult:
    env = os.environ.get("NUMBA_CACHE_DIR")
    fix = "export NUMBA_CACHE_DIR=/var/cache/closedloop (a writable folder; Environment= in a systemd unit)"
    if env:
        where, origin = Path(env), "NUMBA_CACHE_DIR"
    else:
        # numba caches beside the source (a __pycache__ next to the kernels) and falls back to the user's cache
        where, origin = Path(__file__).parent / "__pycache__", "beside the package"
    ok, why = _writable(where)
    if ok:
        return _r(PASS, f"{where} ({origin}) is writable: kernels compile once and load from there after",
                  cache_dir=str(where))
    if env:
        return _r(FAIL, f"NUMBA_CACHE_DIR={env} is not writable ({why}): every session compiles its kernels again",
                  fix, cache_dir=env)
    return _r(WARN, f"{where} is not writable ({why}): numba falls back to the user's cache folder, or compiles "
                    "every session (seconds) where that is read-only too", fix, cache_dir=str(where))


@check("c_scanner", "C frame scanner library")
def _c_scanner(cfg: DoctorConfig) -> CheckResult:
    from closedloop.firmware_bridge import c_library as cl

    path = cl.library_path()
    folder = path.parent
    fix = ("build it where the service looks: CLOSEDLOOP_CACHE_DIR=/var/cache/closedloop python -m "
           "closedloop.firmware_bridge.c_library (install.sh does; Environment=CLOSEDLOOP_CACHE_DIR= in the unit)")
    if path.is_file():
        return _r(PASS, f"{path} is built: sessions parse and encode frames in C", library=str(path))
    if cl._compiler() is not None:
        return _r(WARN, f"not built in {folder}: the first session against a device compiles it (about a second "
                        "before its handshake)", fix, cache_dir=str(folder))
    return _r(WARN, f"not built in {folder} and no C compiler here: sessions use the Python frame parser "
                    "(about 10x slower per frame at high channel counts)", fix, cache_dir=str(folder))


def _writable(folder: Path) -> tuple[bool, str]:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
        return True, ""
    except OSError as exc:
        why = exc.strerror or str(exc)
        owner = _owner(folder)
        if owner is not None and owner != _owner_of_me():  # a service's cache checked as another user
            why += (f"; it belongs to user {owner}: run doctor as that user (sudo -u {owner} env "
                    f"NUMBA_CACHE_DIR=... closedloop doctor), whose rights the service has")
        return False, why


def _owner(folder: Path) -> str | None:
    try:
        return _user_name(folder.stat().st_uid)
    except OSError:
        return None


def _owner_of_me() -> str | None:
    return _user_name(os.geteuid())


def _user_name(uid: int) -> str | None:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return None


# --- the loop ---------------------------------------------------------------------------------------------------

@check("loop_jitter", "loop-jitter probe")
def _jitter(cfg: DoctorConfig) -> CheckResult:
    from .loop import LoopConfig, RealTimeLoop

    loop = RealTimeLoop(LoopConfig(rate_hz=cfg.jitter_rate_hz, duration_s=cfg.jitter_s, capacity=1 << 16))
    s = loop.run(lambda k: None)
    frac = s.missed_deadlines / max(s.steps + s.skipped_periods, 1)
    data = {"rate_hz": s.rate_hz, "duration_s": cfg.jitter_s, "steps": s.steps,
            "lateness_p99_us": s.lateness_p99_us, "lateness_max_us": s.lateness_max_us,
            "missed_deadlines": s.missed_deadlines, "missed_fraction": frac}
    msg = (f"{cfg.jitter_s:g} s at {s.rate_hz:g} Hz (no model): lateness p99 {s.lateness_p99_us:.1f} us, max "
           f"{s.lateness_max_us:.0f} us, missed deadlines {s.missed_deadlines} of {s.steps + s.skipped_periods} "
           f"({100 * frac:.2f}%)")
    fix = ("closedloop run --rt --cpu N, an idle or isolated CPU (isolated CPUs above), and nothing else heavy on "
           "the machine; then run the doctor again")
    if frac > 0.01:
        return _r(FAIL, msg + ": more than 1% missed with an empty step", fix, **data)
    if frac > 0.001 or s.lateness_p99_us > 100:
        return _r(WARN, msg + ": above 0.1% missed or 100 us p99 lateness", fix, **data)
    return _r(PASS, msg, **data)
