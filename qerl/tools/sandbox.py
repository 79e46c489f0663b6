"""Run untrusted Python (a model's tool call) in a separate, confined process per call, and return what it printed.

The layers, each applied where this machine allows it (`SandboxResult.layers` says which held for a call;
`isolation_layers()` probes once):

- always: a process of its own in a new session (the host kills the whole group at the end, on any limit, and
  before reaping, so no reused PID is hit); an empty environment; stdin closed; a fresh working folder, deleted
  afterwards; rlimits on CPU seconds, address space, file size, open files and processes; no core dumps; the
  host's own limits on wall time and on how many bytes it reads.
- root (as here): the program runs with a real uid of its own per concurrent call (so RLIMIT_NPROC holds, which it
  never does for uid 0) and no capabilities, ever.
- namespaces (root, or unprivileged where user namespaces are allowed): no network at all (a new network namespace
  has only a downed loopback), its own PIDs (the host's processes cannot be named, let alone signalled; whatever
  the program leaves running, daemons included, dies with the namespace's init), its own IPC, its own mounts (its
  folder a tmpfs of `disk_mib`).
- Landlock (Linux >= 5.13, unprivileged): reads only the Python installation and the system libraries, writes only
  its working folder, executes only the interpreter; ABI >= 4 no TCP; ABI >= 6 no signals or abstract sockets to
  processes outside the sandbox.
- seccomp (with Landlock): no socket() at all (Landlock leaves connect() to a unix socket by path open), ptrace,
  process_vm_*, io_uring, bpf, perf_event_open, userfaultfd or keyrings.
- a Python audit hook: the same rules at the Python level. PEP 578 hooks are no security boundary (native code and
  interpreter internals go around them); it is the last layer where the kernel ones are missing.

What it is not: a VM or a container. The kernel is shared (a kernel bug is an escape), the program can read what
the Python installation and system libraries hold, and without namespaces and Landlock it runs as the host's uid.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MARKER = "qerl-sandbox"
# Real uids the program runs as when the host is root, one per concurrent call: far above what distributions
# (logins from 1000), container runtimes (subuid ranges from 100000) and systemd (61184-65519) hand out.
UID_BASE = 1_500_000_000
_CHILD_SOURCE = (Path(__file__).with_name("sandbox_child.py")).read_text(encoding="utf-8")
_MiB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. Each limit ends the call when crossed; the result says which."""

    wall_s: float = 10.0        # seconds on the clock, start to end (the host kills the process group)
    cpu_s: int = 5              # CPU seconds of the program's process (RLIMIT_CPU; SIGXCPU, then SIGKILL)
    memory_mib: int = 512       # address space of each process (RLIMIT_AS): a large allocation raises MemoryError
    output_bytes: int = 16 * 1024  # bytes read from stdout, and from stderr; one more ends the call
    processes: int = 16         # processes and threads at once (RLIMIT_NPROC; binding where the uid is its own)
    file_mib: int = 16          # largest file it may write (RLIMIT_FSIZE)
    disk_mib: int = 64          # all its folder may hold (a tmpfs of that size, where it has a mount namespace)
    open_files: int = 64        # file descriptors (RLIMIT_NOFILE)
    code_bytes: int = 1 * _MiB  # longest program accepted

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits.{field.name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None       # None when a signal or the host ended it
    signal: int | None          # the signal that ended the program, if one did
    killed: str | None          # the limit that ended the call ("wall time 10 s"), if one did
    elapsed_s: float
    layers: dict                # the isolation layers that held for this call
    marker: str                 # in the command line of every process of this call (for leftover checks)

    def text(self, max_chars: int = 16 * 1024) -> str:
        """What the model sees: stdout, then stderr, then one line on how it ended when not cleanly; at most
        `max_chars`, keeping the head (the answer) and the tail (the error and the reason)."""
        parts = [p.rstrip("\n") for p in (self.stdout, self.stderr) if p.strip()]
        if self.killed:
            parts.append(f"[killed: {self.killed}]")
        elif self.signal is not None:
            parts.append(f"[killed by signal {_signal_name(self.signal)}]")
        elif self.exit_code not in (0, None) and not self.stderr.strip():
            parts.append(f"[exit code {self.exit_code}]")
        text = "\n".join(parts)
        if len(text) > max_chars:
            half = max_chars // 2
            text = text[:half] + f"\n[... {len(text) - 2 * half} characters cut ...]\n" + text[-half:]
        return text


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class _UidSlots:
    """One uid per concurrent call, so that RLIMIT_NPROC counts that call's processes alone."""

    def __init__(self):
        self._lock, self._free, self._next = threading.Lock(), [], 0

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return UID_BASE + self._next - 1

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


_UIDS = _UidSlots()


def _read_paths(site_packages: bool) -> list[str]:
    """What the program may read: the Python installation, a venv's pyvenv.cfg (and its site-packages, if asked
    for: not the rest of the venv, nor what an editable install's .pth adds), and the system libraries."""
    paths = {sys.base_prefix, sys.base_exec_prefix, os.path.join(sys.prefix, "pyvenv.cfg")}
    if site_packages:
        paths |= {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    paths |= {"/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache",
              "/dev/urandom", "/dev/zero"}
    return sorted(os.path.realpath(p) for p in paths if os.path.exists(p))


def _rlimits(limits: SandboxLimits) -> dict:
    cpu = int(limits.cpu_s)
    return {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (limits.memory_mib * _MiB,) * 2,
        "RLIMIT_FSIZE": (limits.file_mib * _MiB,) * 2,
        "RLIMIT_NOFILE": (limits.open_files,) * 2,
        "RLIMIT_NPROC": (limits.processes,) * 2,
        "RLIMIT_CORE": (0, 0),
    }


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, site_packages: bool = True,
               _kernel_layers: bool = True, _python_guard: bool = True, _unprivileged: bool = False) -> SandboxResult:
    """Run `code` as a Python program in a sandbox (see the module's docstring) and return how it went; never
    raises for anything the code does. Thread-safe: each call is its own processes, folder and uid.
    `site_packages`: whether the installed packages (numpy, sympy, ...) can be imported, or the standard library
    alone. The underscored switches exist for tests: one layer without the others, and (as root) the path a
    non-root host takes (a user namespace of its own, the host's uid kept)."""
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    start = time.monotonic()
    marker = f"{MARKER}:{uuid.uuid4().hex}"
    data = code.encode("utf-8", "replace")
    if len(data) > limits.code_bytes:
        return SandboxResult("", "", None, None, f"code over {limits.code_bytes} bytes", 0.0, {}, marker)
    root = os.geteuid() == 0 and not _unprivileged
    uid = _UIDS.take() if root else os.getuid()
    folder = tempfile.mkdtemp(prefix="qerl-sandbox-")
    status_r = status_w = None
    try:
        work = os.path.join(folder, "work")
        os.mkdir(work, 0o700)
        code_path = os.path.join(folder, "code.py")
        with open(code_path, "wb") as f:
            f.write(data)
        status_r, status_w = os.pipe()
        read_paths = _read_paths(site_packages)
        cfg = {
            "status_fd": status_w, "code_path": code_path, "workdir": work, "python": sys.executable,
            "uid": uid, "rlimits": _rlimits(limits), "disk_bytes": limits.disk_mib * _MiB, "read_paths": read_paths,
            "site_packages": site_packages,
            "namespaces": _kernel_layers, "landlock": _kernel_layers, "as_unprivileged": _unprivileged,
            "guard": {"on": _python_guard, "read_paths": read_paths},
            # numeric libraries start one thread per core unless told: each counts against the process limit
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work,
                    "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "MPLCONFIGDIR": work},
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-X", "utf8", "-c", _CHILD_SOURCE, marker, json.dumps(cfg)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env={},
            start_new_session=True, pass_fds=(status_w,), close_fds=True)
        os.close(status_w)
        status_w = None
        try:
            out, err, status_lines, killed = _collect(proc, status_r, limits, start)
        finally:
            _kill_group(proc)  # before reaping: the group's id cannot have been reused while its leader is unreaped
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        events = {}
        for line in status_lines:
            try:
                events.update(json.loads(line))
            except ValueError:
                pass
        layers = events.get("layers", {})
        if killed or not layers.get("pid_namespace"):
            # Killed by the host: the namespace's init died with the group, but its teardown can lag the launcher's
            # reaping by moments. No namespace: what left the group (setsid) has nothing to take it down.
            _kill_marked(marker)
        exit_code, sig = events.get("exit"), events.get("signal")
        elapsed = time.monotonic() - start
        # SIGXCPU is the soft CPU limit; SIGKILL after more than the CPU seconds is its hard limit (SIGXCPU ignored)
        if killed is None and (sig == signal.SIGXCPU or (sig == signal.SIGKILL and elapsed >= limits.cpu_s + 1)):
            killed = f"CPU time {limits.cpu_s} s"
        stderr = err.decode("utf-8", "replace")
        if "error" in events:  # the confinement failed: the code did not run
            stderr += events["error"]
        return SandboxResult(out.decode("utf-8", "replace"), stderr, exit_code, sig, killed, elapsed, layers, marker)
    finally:
        for fd in (status_r, status_w):
            if fd is not None:
                os.close(fd)
        _remove(folder)
        if root:
            _UIDS.give_back(uid)


def _collect(proc, status_r, limits: SandboxLimits, start: float):
    """Read stdout, stderr and the status pipe until all three close, the wall time passes or an output is over
    its limit; returns (stdout, stderr, status lines, the limit that ended it or None)."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_r: bytearray()}
    deadline = start + limits.wall_s
    killed = None
    with selectors.DefaultSelector() as sel:
        for fd in buffers:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = f"wall time {limits.wall_s:g} s"
                break
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = buffers[key.fd]
                room = (limits.output_bytes if key.fd != status_r else 1 << 16) - len(buf)
                buf += chunk[:max(room, 0)]
                if len(chunk) > room and key.fd != status_r:
                    killed = f"output over {_size(limits.output_bytes)}"
                    break
            if killed:
                break
    status_lines = bytes(buffers[status_r]).decode("utf-8", "replace").splitlines()
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), status_lines, killed


def _size(n: int) -> str:
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} bytes"


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_marked(marker: str, patience_s: float = 2.0) -> None:
    """Kill every process whose command line holds this call's marker (forks of the program keep it) until none is
    left, or `patience_s` has passed (a process in the kernel's hands for long)."""
    needle, give_up = marker.encode(), time.monotonic() + patience_s
    while True:
        found = False
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if needle in f.read():
                            found = True
                            os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
        if not found or time.monotonic() > give_up:
            return
        time.sleep(0.01)


def _remove(folder: str) -> None:
    """Delete the call's folder, whatever modes the program left on what it wrote there."""
    def make_writable_and_retry(func, path, _exc):
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass
    shutil.rmtree(folder, onerror=make_writable_and_retry)


@functools.lru_cache(maxsize=None)
def isolation_layers() -> dict:
    """The layers a call gets on this machine (probed once, with a trivial program)."""
    return run_python("pass", SandboxLimits(wall_s=30)).layers
