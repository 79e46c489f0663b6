"""The sandbox of qerl.tools.sandbox against hostile programs: each ends within its limits, the host process and
everything outside the sandbox are untouched (files, listeners, processes), and nothing of a call outlives it.

The hostile table runs once per variant, all cases at once on a thread pool (as the engine calls tools), with small
limits so the module takes seconds: "all" is what a tool call gets; "kernel" switches the Python audit hook off, to
show the kernel's layers hold on their own where this machine has them (else it is skipped, saying why).
"""

from __future__ import annotations

import glob
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from qerl.tools.sandbox import MARKER, SandboxLimits, isolation_layers, run_python

LIMITS = SandboxLimits(wall_s=2, cpu_s=1, memory_mib=256, output_bytes=4096, processes=8, file_mib=1, disk_mib=8)
MARGIN_S = 3.0  # the host's kill, reaping and clean-up, on two busy cores
SECRET = f"qerl-secret-{uuid.uuid4().hex}"


def kernel_layers_hold() -> bool:
    layers = isolation_layers()
    return bool(layers.get("net_namespace") and layers.get("pid_namespace") and isinstance(layers.get("landlock"), int)
                and layers.get("seccomp") is True)


def killed(r) -> str:
    return r.killed or ""


# name -> (program, check(result, world)); the program's {placeholders} are filled from `world` (the test's own
# pid, a planted file, listeners). Every case is also checked for what all share (see test_hostile_program).
CASES = {
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  lambda r, w: killed(r)),
    "infinite loop": ("while True:\n    pass", lambda r, w: killed(r).startswith(("CPU", "wall"))),
    "busy loop that ignores SIGXCPU and SIGTERM":
        ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)"
         "\nx = 0\nwhile True:\n    x += 1", lambda r, w: killed(r) or r.signal == signal.SIGKILL),
    "raise its own limits, then loop":
        ("import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY,) * 2)\n"
         "    print('RAISED')\nexcept (ValueError, OSError) as e:\n    print('refused', e)\nwhile True:\n    pass",
         lambda r, w: "RAISED" not in r.stdout and killed(r)),
    "sleep past the wall time": ("import time\ntime.sleep(60)", lambda r, w: killed(r).startswith("wall")),
    "a 10 GB allocation": ("x = bytearray(10 * 1024 ** 3)\nprint('GOT IT')",
                           lambda r, w: "MemoryError" in r.stderr and "GOT IT" not in r.stdout),
    "allocate until it fails": ("xs = []\nwhile True:\n    xs.append(bytearray(32 * 1024 ** 2))",
                                lambda r, w: "MemoryError" in r.stderr or r.signal is not None or killed(r)),
    "read /etc/passwd": ("print(open('/etc/passwd').read())", lambda r, w: "root:" not in r.stdout),
    "read a file planted outside its folder": ("print(open({secret_path!r}).read())",
                                                lambda r, w: SECRET not in r.text()),
    "list the planted folder": ("import os\nprint(os.listdir({outside!r}))",
                                lambda r, w: "planted.txt" not in r.stdout),
    "follow a symlink to the planted file": ("import os\nos.symlink({secret_path!r}, 'link')\nprint(open('link').read())",
                                              lambda r, w: SECRET not in r.text()),
    "hard-link the planted file": ("import os\nos.link({secret_path!r}, 'hard')\nprint(open('hard').read())",
                                   lambda r, w: SECRET not in r.text()),
    "the host's secret in os.environ": ("import os\nprint(dict(os.environ))", lambda r, w: SECRET not in r.text()),
    "/proc/self/environ": ("print(open('/proc/self/environ', 'rb').read())", lambda r, w: SECRET not in r.text()),
    "the host's /proc/PID/environ": ("print(open('/proc/{host_pid}/environ', 'rb').read())",
                                     lambda r, w: SECRET not in r.text()),
    "TCP to a port the test listens on":
        ("import socket\ns = socket.create_connection(('127.0.0.1', {tcp_port}), timeout=1)\ns.sendall(b'escaped')\n"
         "print('SENT')", lambda r, w: "SENT" not in r.stdout),
    "UDP to a port the test listens on":
        ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
         "s.sendto(b'escaped', ('127.0.0.1', {udp_port}))\nprint('SENT')", lambda r, w: "SENT" not in r.stdout),
    "a unix socket the test listens on":
        ("import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({unix_path!r})\ns.sendall(b'escaped')\n"
         "print('SENT')", lambda r, w: "SENT" not in r.stdout),
    "ctypes: a raw socket() and kill() of the host":
        ("import ctypes\nlibc = ctypes.CDLL(None)\nfd = libc.socket(2, 1, 0)\nprint('SOCKET' if fd >= 0 else 'no socket')"
         "\nlibc.kill({host_pid}, 9)\nlibc.ptrace(16, {host_pid}, 0, 0)", lambda r, w: "SOCKET" not in r.stdout),
    "kill its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('done')", lambda r, w: True),
    "kill the host by PID": ("import os, signal\nos.kill({host_pid}, signal.SIGKILL)", lambda r, w: True),
    "killpg the host's group": ("import os, signal\nos.killpg({host_pgid}, signal.SIGKILL)", lambda r, w: True),
    "killpg its own group": ("import os, signal\nos.killpg(0, signal.SIGKILL)", lambda r, w: True),
    "kill(-1): every process it may signal":
        ("import os, signal, time\nif os.fork() == 0:\n    time.sleep(30)\nos.kill(-1, signal.SIGKILL)\nprint('done')",
         lambda r, w: True),
    "a daemonized double-fork child":
        ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
         "    os._exit(0)\nprint('parent done')", lambda r, w: "parent done" in r.stdout),
    "deep recursion": ("import sys\nsys.setrecursionlimit(10 ** 7)\ndef f(n):\n    return f(n + 1)\nf(0)",
                       lambda r, w: r.exit_code != 0),
    "spawn 200 threads":
        ("import threading, time\nfor _ in range(200):\n    threading.Thread(target=time.sleep, args=(30,)).start()",
         lambda r, w: "can't start new thread" in r.stderr or killed(r)),
    "1 GB to stdout": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
                       lambda r, w: killed(r).startswith("output") and len(r.stdout) <= LIMITS.output_bytes),
    "1 GB to stderr": ("import sys\nwhile True:\n    sys.stderr.write('x' * 65536)",
                       lambda r, w: killed(r).startswith("output") and len(r.stderr) <= LIMITS.output_bytes),
    "a 1 GB file": ("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))",
                    lambda r, w: "File too large" in r.stderr or r.signal == signal.SIGXFSZ),
    "fill the disk with many files": ("for i in range(1000):\n    with open(f'f{{i}}', 'wb') as f:\n"
                                      "        f.write(b'x' * (1 << 20))",
                                      lambda r, w: "No space left on device" in r.stderr),
    "close stdout and stderr, then hang": ("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)",
                                           lambda r, w: killed(r).startswith("wall")),
    "write outside its folder":
        ("for path in ({outside!r} + '/escaped.txt', {escape_tmp!r}):\n    try:\n        open(path, 'w').write('x')\n"
         "    except OSError as e:\n        print('refused', e)", lambda r, w: True),
    "overwrite the planted file": ("open({secret_path!r}, 'w').write('pwned')", lambda r, w: True),
    "start a shell": ("import os\nos.system('echo ESCAPED; cat /etc/passwd')\n"
                      "os.execv('/bin/sh', ['sh', '-c', 'echo ESCAPED'])",
                      lambda r, w: "ESCAPED" not in r.stdout and "root:" not in r.stdout),
    "leave an unremovable tree in its folder":
        ("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0)\nos.chmod('a', 0)\n"
         "print('left')", lambda r, w: "left" in r.stdout),
}


# The path a non-root host takes (its own user namespace, its uid kept), exercised from root: the cases that stay
# harmless there (as uid 0 inside, RLIMIT_NPROC does not bind, so no fork bomb).
UNPRIVILEGED_CASES = ["read a file planted outside its folder", "the host's secret in os.environ",
                      "the host's /proc/PID/environ", "TCP to a port the test listens on",
                      "UDP to a port the test listens on", "a unix socket the test listens on",
                      "a daemonized double-fork child", "write outside its folder", "sleep past the wall time"]
VARIANTS = {"all": {}, "kernel": {"_python_guard": False}, "unprivileged": {"_unprivileged": True}}
JOBS = [(v, n) for v in ("all", "kernel") for n in CASES] + [("unprivileged", n) for n in UNPRIVILEGED_CASES]


class Listeners:
    """TCP, UDP and unix-socket listeners on this host, recording whatever reaches them."""

    def __init__(self, folder: str):
        self.received: list[str] = []
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix_path = os.path.join(folder, "listener.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._serve, args=(s,), daemon=True) for s in (self.tcp, self.unix)]
        self.threads.append(threading.Thread(target=self._serve_udp, daemon=True))
        for t in self.threads:
            t.start()

    def _serve(self, server):
        server.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            self.received.append(f"connection on {server.family.name}")
            conn.close()

    def _serve_udp(self):
        self.udp.settimeout(0.1)
        while not self.stop.is_set():
            try:
                data, _ = self.udp.recvfrom(100)
            except OSError:
                continue
            self.received.append(f"datagram {data!r}")

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join()
        for s in (self.tcp, self.udp, self.unix):
            s.close()


def sandbox_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "qerl-sandbox-*")))


def marked_processes(markers) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            found += [f"{entry}: {m}" for m in markers if m.encode() in line]
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The host's side: a secret in its environment and in a world-readable file outside any sandbox folder,
    listeners, a canary process of the host's uid; then every case of every variant run at once."""
    outside = tmp_path_factory.mktemp("outside")
    secret_path = outside / "planted.txt"
    secret_path.write_text(SECRET)
    os.chmod(outside, 0o755)
    os.chmod(secret_path, 0o644)
    planted = (secret_path.read_bytes(), secret_path.stat().st_mtime_ns)
    listeners = Listeners(str(outside))
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    old_secret = os.environ.get("QERL_TEST_SECRET")
    os.environ["QERL_TEST_SECRET"] = SECRET
    limits_before = {r: resource.getrlimit(r) for r in (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_CPU)}
    folders_before = sandbox_folders()
    escape_tmp = os.path.join(tempfile.gettempdir(), f"qerl-escape-{uuid.uuid4().hex}")
    fill = {"secret_path": str(secret_path), "outside": str(outside), "host_pid": os.getpid(),
            "host_pgid": os.getpgid(0), "tcp_port": listeners.tcp.getsockname()[1],
            "udp_port": listeners.udp.getsockname()[1], "unix_path": listeners.unix_path, "escape_tmp": escape_tmp}
    runs = {"all"} | ({"kernel"} if kernel_layers_hold() else set()) | ({"unprivileged"} if os.geteuid() == 0 else set())
    jobs = [job for job in JOBS if job[0] in runs]
    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            futures = {job: pool.submit(run_python, CASES[job[1]][0].format(**fill), LIMITS, **VARIANTS[job[0]])
                       for job in jobs}
            results = {job: f.result() for job, f in futures.items()}
    finally:
        os.environ.pop("QERL_TEST_SECRET")
        if old_secret is not None:
            os.environ["QERL_TEST_SECRET"] = old_secret
        time.sleep(0.3)  # a datagram or a connection in flight reaches the listeners
        listeners.close()
    canary_alive = canary.poll() is None
    canary.kill()
    canary.wait()
    yield {"results": results, "received": listeners.received, "planted": planted, "secret_path": secret_path,
           "outside": outside, "canary_alive": canary_alive, "limits_before": limits_before,
           "folders_before": folders_before, "escape_tmp": escape_tmp}


@pytest.mark.parametrize("variant,name", JOBS, ids=[f"{v}: {n}" for v, n in JOBS])
def test_hostile_program(world, name, variant):
    if (variant, name) not in world["results"]:
        pytest.skip("the kernel layers do not all hold here" if variant == "kernel" else "the host is not root, so "
                    "the 'all' variant is this path already")
    r = world["results"][(variant, name)]
    if variant == "unprivileged":
        assert r.layers["root"] is False and r.layers["pid_namespace"] and r.layers["net_namespace"], r.layers
    assert r.elapsed_s < LIMITS.wall_s + MARGIN_S, f"{name}: took {r.elapsed_s:.1f} s"
    assert "sandbox set-up failed" not in r.stderr, r.stderr
    assert SECRET not in r.text(), f"{name}: the secret leaked: {r.text()[:300]}"
    assert len(r.stdout) <= LIMITS.output_bytes and len(r.stderr) <= LIMITS.output_bytes
    assert CASES[name][1](r, world), f"{name}: {r.text()[-600:]!r} (killed={r.killed}, signal={r.signal})"


def test_nothing_outside_the_sandbox_changed(world):
    assert world["canary_alive"], "a process of the host's uid was killed"
    assert world["received"] == [], f"the host's listeners were reached: {world['received']}"
    path = world["secret_path"]
    assert (path.read_bytes(), path.stat().st_mtime_ns) == world["planted"]
    assert sorted(p.name for p in world["outside"].iterdir()) == ["listener.sock", "planted.txt"]
    assert not os.path.exists(world["escape_tmp"])
    assert {r: resource.getrlimit(r) for r in world["limits_before"]} == world["limits_before"]


def test_nothing_of_a_call_outlives_it(world):
    assert sandbox_folders() <= world["folders_before"], "a call's folder was left behind"
    markers = [r.marker for r in world["results"].values()]
    assert all(m.startswith(MARKER) for m in markers)
    assert marked_processes(markers) == []


def test_the_layers_this_machine_gives_are_reported():
    layers = isolation_layers()
    assert {"root", "pid_namespace", "net_namespace", "landlock"} <= set(layers)
    if sys.platform == "linux" and os.geteuid() == 0:
        assert layers["uid"] >= 1_500_000_000  # root never runs the program as uid 0


# --- what a well-behaved program gets ----------------------------------------------------------------------------

def test_a_program_prints_and_its_errors_come_back():
    r = run_python("print(6 * 7)\nimport sys\nprint('warn', file=sys.stderr)\nraise SystemExit(3)", LIMITS)
    assert (r.stdout, r.stderr, r.exit_code, r.killed) == ("42\n", "warn\n", 3, None)
    r = run_python("x = 1\n1 / 0", LIMITS)
    assert r.exit_code == 1 and r.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert 'File "<code>", line 2' in r.stderr and "sandbox_child" not in r.stderr and "_main" not in r.stderr


def test_installed_packages_import_unless_asked_for_the_standard_library_alone():
    assert run_python("import sympy\nprint(sympy.factor('x**2 - 1'))", LIMITS).stdout == "(x - 1)*(x + 1)\n"
    r = run_python("import sympy", LIMITS, site_packages=False)
    assert "ModuleNotFoundError: No module named 'sympy'" in r.stderr


def test_the_program_has_its_own_folder_and_files_it_writes_stay_there():
    r = run_python("import os\nopen('a.txt', 'w').write('hi')\nprint(os.listdir('.'), open('a.txt').read())", LIMITS)
    assert r.stdout == "['a.txt'] hi\n"
    assert run_python("import os\nprint(os.listdir('.'))", LIMITS).stdout == "[]\n"  # a fresh folder each call


def test_concurrent_calls_keep_their_outputs_apart():
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})", LIMITS), range(16)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(16)]


def test_the_text_for_the_model_says_how_a_call_ended_and_stays_short():
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", SandboxLimits(wall_s=1))
    assert r.text() == "started\n[killed: wall time 1 s]"
    long = run_python("print('a' * 3000 + 'b' * 3000)", LIMITS.__class__(output_bytes=8192)).text(max_chars=1000)
    assert len(long) < 1100 and long.startswith("a" * 500) and long.endswith("b" * 500)
    assert run_python("import sys\nsys.exit(4)", LIMITS).text() == "[exit code 4]"


def test_code_over_the_size_limit_is_refused_without_running():
    r = run_python("x = 1\n" * 100, SandboxLimits(code_bytes=100))
    assert r.killed == "code over 100 bytes" and r.text() == "[killed: code over 100 bytes]"


@pytest.mark.parametrize("field,value", [("wall_s", 0), ("memory_mib", -1), ("processes", "8"), ("cpu_s", True)])
def test_bad_limits_are_one_line_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^SandboxLimits\.{field} must be a positive number, got {value!r}$"):
        SandboxLimits(**{field: value})
