"""The sandbox's child side, run by `qerl.tools.sandbox` as `python -I -S -X utf8 -c <this file's text> MARKER CONFIG`.

It is its own program, not a module of qerl: it imports only the standard library (it must run before, and apart
from, anything of the host) and reads everything it needs from CONFIG (JSON). Three processes, each with one job:

- the *launcher* (the host's direct child, leader of its own process group): enters new network, PID and IPC
  namespaces where the kernel lets it (as root directly, otherwise inside a new user namespace), then forks
- *init* (PID 1 of the new PID namespace, where there is one): forks the program, reaps, and when the program has
  ended writes its exit status to the status pipe and exits, which makes the kernel kill whatever the program left
  running in the namespace (a daemonized grandchild included). Without a PID namespace it is a child subreaper and
  kills what it inherits itself. The program cannot signal it (PID 1 ignores signals it has no handler for).
- the *program*: lowers its limits (rlimits), gives up root where it ran as root (a real uid of its own for the
  process count, no capabilities, no new privileges), confines itself with Landlock where the kernel has it (read
  only the Python installation and system libraries, write only its working folder, no TCP, no signals or abstract
  sockets beyond its own processes), then execs a fresh interpreter on RUNNER, which installs a Python audit hook
  (the weakest layer, for machines without the others) and runs the code.

The status pipe (its fd in CONFIG) carries JSON lines to the host: the layers in force, then the program's status.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = \
    0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 36, 38
# SECBIT_NOROOT(+_LOCKED), SECBIT_NO_SETUID_FIXUP(+_LOCKED), SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE(+_L.)
SECURE_BITS = 0b11101111
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # on every arch
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1      # execute ... make_sym: what ABI 1 handles
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2                             # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2                  # ABI 6

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _check(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def status(fd, **fields):
    os.write(fd, (json.dumps(fields) + "\n").encode())


# --- namespaces (the launcher) -----------------------------------------------------------------------------------

def enter_namespaces(root):
    """New network (only a downed loopback), PID and IPC namespaces; the reason they are absent otherwise."""
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS
    uid, gid = os.geteuid(), os.getegid()
    try:
        if root:
            _check(libc.unshare(flags), "unshare")
        else:  # unprivileged: a user namespace of our own owns the others; we stay our uid inside it
            _check(libc.unshare(flags | CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
        return None
    except OSError as e:
        return str(e)


def size_the_folder(cfg):
    """Make the working folder a tmpfs of `disk_bytes` in our own mount namespace: RLIMIT_FSIZE bounds each file,
    this bounds them all. Mounts stay private to the namespace (nothing propagates to the host's)."""
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(/, MS_PRIVATE)")
    options = f"size={cfg['disk_bytes']},mode=0700".encode()
    _check(libc.mount(b"tmpfs", cfg["workdir"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), "mount(tmpfs)")
    os.chdir(cfg["workdir"])  # the mount covers the folder: our working directory was the folder beneath it


# --- the program's own confinement -------------------------------------------------------------------------------

def drop_root(uid, keep_euid):
    """Run as real uid `uid` (RLIMIT_NPROC then counts this call's processes alone) without any capability, for good
    (bounding set emptied, securebits locked so no exec of a set-uid-root file or of anything as uid 0 gives them
    back). `keep_euid`: effective uid 0 stays, so the Python installation remains readable where it lives in root's
    home (as on pyenv machines); only where Landlock confines the file system, as uid 0 owns most files."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    _check(libc.prctl(PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")  # needs CAP_SETPCAP:
    for cap in range(64):                                                                   # first, as these
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    os.setresuid(uid, 0, 0) if keep_euid else os.setresuid(uid, uid, uid)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


# seccomp: syscalls a sandboxed program never needs and that reach past the other layers. socket() above all:
# Landlock does not cover connect() to a unix socket by path, and socketpair() (a separate syscall) stays for
# multiprocessing. x86_64 and aarch64 numbers; elsewhere no filter (and the layer is reported missing).
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
DENIED_SYSCALLS = {  # arch: (AUDIT_ARCH, {name: number})
    "x86_64": (0xC000003E, {"socket": 41, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
                            "io_uring_setup": 425, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
                            "keyctl": 250, "add_key": 248, "request_key": 249}),
    "aarch64": (0xC00000B7, {"socket": 198, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                             "io_uring_setup": 425, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
                             "keyctl": 219, "add_key": 217, "request_key": 218}),
}


def seccomp():
    """Deny DENIED_SYSCALLS with EACCES (and any syscall of a foreign ABI, e.g. 32-bit entry points, kills)."""
    machine = os.uname().machine
    if machine not in DENIED_SYSCALLS:
        return f"no seccomp filter for {machine}"
    audit_arch, numbers = DENIED_SYSCALLS[machine]

    def op(code, k, jt=0, jf=0):
        return struct.pack("<HBBI", code, jt, jf, k)

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    deny = SECCOMP_RET_ERRNO | 13
    nrs = sorted(numbers.values())
    prog = [op(ld, 4), op(jeq, audit_arch, 1, 0), op(ret, SECCOMP_RET_KILL_PROCESS), op(ld, 0)]
    if machine == "x86_64":  # the x32 ABI: the same syscalls with bit 30 set
        prog.append(op(jge, 0x40000000, len(nrs) + 1, 0))
    for i, nr in enumerate(nrs):
        prog.append(op(jeq, nr, len(nrs) - i, 0))
    prog += [op(ret, SECCOMP_RET_ALLOW), op(ret, deny)]
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(buf))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0), "prctl(PR_SET_SECCOMP)")
    return True


def landlock_abi():
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return abi if abi >= 1 else None


def tasks_of(uid):
    """Processes and threads whose real uid is `uid`: what RLIMIT_NPROC counts against."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def set_limits(cfg, root):
    for name, value in cfg["rlimits"].items():
        if name == "RLIMIT_NPROC" and not root:
            # not root: the uid is the host's, with its other processes (in a user namespace too: the count is
            # charged up to the namespace's owner), so the limit is on top of what it runs already
            running = tasks_of(os.getuid())
            value = [v + running for v in value]
        resource.setrlimit(getattr(resource, name), tuple(value))


def elf_interpreter(path):
    """The dynamic loader an executable names (PT_INTERP), which exec opens as an executable too."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return None
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            kind, _flags, offset, _vaddr, _paddr, size = struct.unpack("<IIQQQQ", f.read(40))
            if kind == 3:  # PT_INTERP
                f.seek(offset)
                return f.read(size).rstrip(b"\0").decode()
    return None


def landlock(cfg):
    """Confine this process and everything it starts; returns the ABI in force, or why none is."""
    abi = landlock_abi()
    if abi is None:
        return None, f"Landlock unavailable ({os.strerror(ctypes.get_errno())})"
    fs = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) \
        | (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("<QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)

    def allow(path, rights):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # an optional path this system lacks
        try:
            if not os.path.isdir(path):
                rights &= file_rights
            rule = struct.pack("<Qi", rights & fs, fd)
            _check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0),
                   f"landlock_add_rule({path})")
        finally:
            os.close(fd)

    for path in cfg["read_paths"]:
        allow(path, FS_READ_FILE | FS_READ_DIR)
    allow("/dev/null", FS_READ_FILE | FS_WRITE_FILE)
    everything_but_exec = fs & ~FS_EXECUTE
    allow(cfg["workdir"], everything_but_exec)
    for exe in (os.path.realpath(cfg["python"]), elf_interpreter(os.path.realpath(cfg["python"]))):
        if exe:
            allow(os.path.realpath(exe), FS_EXECUTE | FS_READ_FILE)
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)
    return abi, None


def confine_and_exec(cfg, code, layers, status_fd, root):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    set_limits(cfg, root)
    if root:
        drop_root(cfg["uid"], keep_euid=bool(cfg["landlock"] and landlock_abi()))
        layers["uid"] = cfg["uid"]
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if cfg["landlock"]:
        abi, why = landlock(cfg)
        layers["landlock"] = abi or why
        layers["seccomp"] = seccomp()
    else:
        layers["landlock"] = layers["seccomp"] = "off (asked)"
    status(status_fd, layers=layers)
    # ctypes only goes around the audit hook; forbid it only where the hook is the last barrier (sympy needs it)
    cfg["guard"]["no_ctypes"] = not (layers["net_namespace"] and isinstance(layers["landlock"], int)
                                     and layers["seccomp"] is True)
    # The code goes to the fresh interpreter through an anonymous file, so it needs no path it could read.
    fd = os.memfd_create("code", 0)
    os.write(fd, code)
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    argv = [cfg["python"], "-I", "-X", "utf8"] + ([] if cfg["site_packages"] else ["-S"]) \
        + ["-c", RUNNER, cfg["marker"], str(fd), json.dumps(cfg["guard"])]
    try:
        os.execve(cfg["python"], argv, cfg["env"])
    except PermissionError as e:
        if root and not isinstance(layers.get("landlock"), int):  # the program is wholly its own uid
            raise PermissionError(f"{e} (without Landlock the program runs as uid {cfg['uid']}, which cannot read "
                                  "this Python installation: install Python where every user can read it)") from None
        raise


# --- init ----------------------------------------------------------------------------------------------------------

def kill_children():
    """Without a PID namespace: kill what was reparented to us (a child subreaper) until nothing is left."""
    me = str(os.getpid())
    while True:
        found = False
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = f.read().rsplit(")", 1)[1].split()[1]
                except (OSError, IndexError):
                    continue
                if ppid == me:
                    found = True
                    try:
                        os.kill(int(entry), signal.SIGKILL)
                    except OSError:
                        pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            if not found:
                return


def init(cfg, code, layers, status_fd, root):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the host killed the launcher: the namespace goes too
    if not layers["pid_namespace"]:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    program = os.fork()
    if program == 0:
        try:
            confine_and_exec(cfg, code, layers, status_fd, root)
        except BaseException as e:  # noqa: BLE001 - whatever stops the confinement, the code must not run
            status(status_fd, layers=layers, error=f"sandbox set-up failed: {e}")
        os._exit(125)
    while True:
        try:
            pid, wstatus = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == program:
            if os.WIFSIGNALED(wstatus):
                status(status_fd, signal=os.WTERMSIG(wstatus))
            else:
                status(status_fd, exit=os.waitstatus_to_exitcode(wstatus))
            break
    if not layers["pid_namespace"]:
        kill_children()
    os._exit(0)


def main():
    marker, cfg = sys.argv[1], json.loads(sys.argv[2])
    cfg["marker"] = marker
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # the exec'd program never holds it
    with open(cfg["code_path"], "rb") as f:
        code = f.read()
    root = os.geteuid() == 0 and not cfg["as_unprivileged"]  # the switch: tests of the unprivileged path, as root
    layers = {"root": root}
    why = enter_namespaces(root) if cfg["namespaces"] else "off (asked)"
    layers["pid_namespace"] = layers["net_namespace"] = why is None
    if why:
        layers["namespaces_missing"] = why
    else:
        try:
            size_the_folder(cfg)
            layers["folder_size"] = cfg["disk_bytes"]
        except OSError as e:
            layers["folder_size"] = str(e)
    child = os.fork()
    if child == 0:
        init(cfg, code, layers, status_fd, root)
    os.waitpid(child, 0)


RUNNER = r'''
import os, sys
def _main():
    fd, guard = int(sys.argv[2]), __import__("json").loads(sys.argv[3])
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    code = b"".join(chunks).decode("utf-8", "replace")
    work = os.getcwd()
    sys.path.insert(0, work)
    if guard["on"]:
        _install_guard(work, tuple(guard["read_paths"]), guard["no_ctypes"])
    return compile(code, "<code>", "exec")

def _install_guard(work, read_paths, no_ctypes):
    """A Python audit hook: no network sockets, no files outside the allowed folders, no programs started, no
    ctypes, no signals to other processes. Python-level only (PEP 578 hooks are no security boundary: native code
    goes around them); the kernel layers are what hold where the kernel has them."""
    import socket as _socket
    real, sep, pid = os.path.realpath, os.sep, os.getpid()
    def under(path, roots):
        return any(path == r or path.startswith(r.rstrip(sep) + sep) for r in roots)
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if not isinstance(path, (str, bytes)) or path in ("/dev/null",):
                return
            path = real(os.fsdecode(path))
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) \
                or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if not under(path, (work,) if writes else (work,) + read_paths):
                raise PermissionError(f"sandbox: no access to {path}")
        elif event == "socket.__new__" and args[1] != _socket.AF_UNIX:
            raise PermissionError("sandbox: no network")
        elif event in ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn"):
            raise PermissionError("sandbox: no programs can be started")
        elif no_ctypes and event == "import" and args[0] in ("ctypes", "_ctypes"):
            raise ImportError("sandbox: ctypes is not available")
        elif event in ("os.kill", "os.killpg") and not (event == "os.kill" and args[0] == os.getpid()):
            raise PermissionError("sandbox: no signals to other processes")
    sys.addaudithook(hook)

_code = _main()
del _main, _install_guard
_globals = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(_code, _globals)
except SystemExit:
    raise
except BaseException as _e:
    import traceback
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.stderr.flush()
    os._exit(1)
'''

if __name__ == "__main__":
    main()
