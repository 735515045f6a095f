"""Bootstrap of the `python` tool's child interpreter (run as `python -I -S -B -u _sandbox_boot.py CONFIG`).

It is the first code in the child, uses only the standard library (plus ctypes for the kernel calls) and
runs before any model code. In the kernel sandbox it is PID 1 of its PID namespace. In order, it:
1. reads its config; as PID 1, makes the signals a namespace's init would ignore (SIGXCPU of the CPU
   limit, SIGALRM, SIGTERM, ...) end it with status 128 + signal,
2. sets resource limits with hard == soft (CPU seconds, address space, processes, file size, open
   files, POSIX message queues, no core dumps); without CAP_SYS_RESOURCE the kernel never lets the code
   raise a hard limit,
3. when asked (`mount_scratch`), enters a mount namespace of its own, mounts the scratch tmpfs with
   `size=` and `nr_inodes=` (bubblewrap cannot set an inode limit), then drops every capability,
4. loads the seccomp filter the parent sent (`src/agentloop/tools/sandbox/policy.py`: no fork/exec, ptrace,
   namespaces, mounts, bpf, keyrings, modules, io_uring, non-AF_UNIX sockets, ...; without a memory
   cgroup also SysV shm/msg, memfd, POSIX mqueues — and checks those are refused) — irreversible, and
   inherited by every thread,
5. checks what the kernel says about this process (`require_isolation`): no capabilities, no_new_privs,
   seccomp in filter mode, a user namespace whose uids are not host root, a network namespace with
   nothing but its loopback, PID 1 of a PID namespace, a tmpfs root where only scratch, /proc and the
   device nodes are mounted writable, a scratch with its inode limit — and exits with status 111 and a
   "sandbox-boot:" message instead of running the code when any of it does not hold,
6. enters the scratch directory,
7. unless the parent turned it off (`audit_hook: false`, a switch for tests that show the kernel layers
   hold on their own), installs an audit hook (PEP 578; a hook cannot be removed once added) that refuses:
   - opening a file for writing, or any path-changing os call (mkdir, remove, rename, link, chmod, ...),
     outside the scratch directory (paths are resolved with realpath; paths with ".." and creating
     symlinks are refused, so no check-then-use race with another thread can escape),
   - reading or listing anything but the scratch directory, the interpreter's import path and a few
     harmless files (unless the parent turned `restrict_reads` off),
   - opening directories (a directory fd would let `os.*(dir_fd=...)` resolve paths the hook never sees),
   - chdir out of the scratch directory,
   - creating processes (fork, exec, spawn, system, subprocess), signalling processes, changing limits,
   - every socket operation, and importing socket/ssl/ctypes/_posixsubprocess/gc/sqlite3/dbm/...,
   and it strips the unaudited `pidfd_open`/`pidfd_send_signal`/`mkfifo`/`mknod`/`chroot`/`setpriority`/`sched_set*`
   from os/posix/signal,
8. runs the code as `__main__` in a fresh module namespace.

The audit hook is defence in depth only: code in the same interpreter can switch it off (e.g. with
hand-made code objects that write the interpreter's memory). The guarantees come from the kernel:
namespaces and the minimal root (set up by the parent, see `src/agentloop/tools/sandbox/namespaces.py`),
rlimits and seccomp (set here, before the code exists as code).
"""

import marshal
import os
import resource
import signal
import sys
import types


def _count_tasks_of(uid):
    """Processes+threads of `uid` now: RLIMIT_NPROC counts all of them, not just ours."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat("/proc/" + name).st_uid == uid:
                    n += len(os.listdir("/proc/" + name + "/task"))
            except OSError:
                pass
    return n


def _set_limits(cfg, uid):
    limits = [
        (resource.RLIMIT_CPU, cfg["cpu_seconds"]),
        (resource.RLIMIT_AS, cfg["memory_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
        (resource.RLIMIT_NOFILE, cfg["open_files"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MSGQUEUE, 0),  # POSIX message queues: kernel memory outside the address space
    ]
    if cfg.get("max_processes") is not None:
        limits.append((resource.RLIMIT_NPROC, _count_tasks_of(uid) + cfg["max_processes"]))
    for which, value in limits:
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        new_hard = value
        if which == resource.RLIMIT_CPU and (hard == resource.RLIM_INFINITY or value + 1 <= hard):
            new_hard = value + 1  # soft limit: SIGXCPU; one second later the kernel sends SIGKILL
        resource.setrlimit(which, (value, new_hard))


def _make_hook(scratch, blocked_imports, readable):
    """Build the audit hook.

    The hook has to survive code that tries to fool it, so it is one function with no helpers and it
    calls nothing the code could patch: its free variables are immutable values (str, tuple, frozenset)
    and C functions captured here (posix.lstat, not os.path.realpath, whose module globals the code
    could monkeypatch; not builtins, which the code could replace). Inner helper functions would share
    closure cells that a traceback's frames expose, so there are none. Paths are copied to exact str
    before use (a str subclass could override split/startswith) and anything else path-like is refused
    (its __fspath__ could answer differently to the hook and to the real call)."""
    import posix

    _lstat, _stat, _readlink, _getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    _type, _isinstance, _int, _str, _bytes, _zip, _bool = type, isinstance, int, str, bytes, zip, bool
    _str_copy, _bytes_copy, _all = str.__getitem__, bytes.__getitem__, slice(None)
    _PermissionError, _ImportError, _OSError = PermissionError, ImportError, OSError
    fs_encoding = sys.getfilesystemencoding()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked_events = frozenset((
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "pty.spawn",
    ))
    blocked_prefixes = ("socket.", "ctypes.", "_posixsubprocess.", "sqlite3.", "dbm.")
    # events whose first argument (second group: first two) are paths that the call changes
    mutating_1 = frozenset(("os.mkdir", "os.rmdir", "os.remove", "os.chmod", "os.chown", "os.utime", "os.truncate",
                            "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "os.chdir"))
    mutating_2 = frozenset(("os.rename", "os.link"))
    scratch_prefix = scratch + "/"
    roots = tuple(readable) if readable is not None else None
    root_prefixes = tuple(r if r.endswith("/") else r + "/" for r in readable) if readable is not None else None
    WRITE, READ = 1, 2

    # Why ".." and symlinks are refused: the hook checks a path, then the call resolves it again. With
    # no symlinks in the scratch directory and no "..", a path that is inside at check time stays inside
    # even if another thread renames directories in between (renames are confined to the scratch dir).
    def hook(event, args):
        if event == "import":
            name = args[0]
            name = _str_copy(name, _all) if _isinstance(name, _str) else "?"
            for part in name.split("."):  # every component: an extension's init symbol is the last one
                if part in blocked_imports:
                    raise _ImportError("sandbox: import of %r is not allowed (no network, processes, ctypes or gc)" % (name,))
            return
        if event in blocked_events or event.startswith(blocked_prefixes):
            raise _PermissionError("sandbox: %s refused: no processes, signals, limit changes, databases or network" % event)
        if event == "os.symlink":
            raise _PermissionError("sandbox: creating symlinks is not allowed")
        if event == "open":
            path, mode, flags = args
            if _type(path) is _int:  # wrapping an fd that was checked when it was opened
                return
            # Anything but a plain str mode / int flags is taken as a write (a subclass could lie).
            writing = False
            if mode is not None:
                if _isinstance(mode, _str):
                    m = _str_copy(mode, _all)
                    writing = "w" in m or "a" in m or "x" in m or "+" in m
                else:
                    writing = True
            if flags is not None and not writing:
                writing = _type(flags) is not _int or _bool(flags & write_flags)
            checks = ((path, WRITE if writing else READ),)
        elif event == "os.listdir" or event == "os.scandir":
            path = args[0]
            if _type(path) is _int:
                return
            checks = (("." if path is None or path == "" else path, READ),)
        elif event in mutating_1:
            checks = ((args[0], WRITE),)
        elif event in mutating_2:
            checks = ((args[0], WRITE), (args[1], WRITE))
        else:
            return
        for path, need in checks:
            t = _type(path)
            if t is _int:  # f-functions (fchmod, futimes, ...): judge the file the fd refers to
                if path < 0:
                    continue
                try:
                    path = _readlink("/proc/self/fd/%d" % path)
                except _OSError:
                    raise _PermissionError("sandbox: %s on fd %d refused" % (event, path)) from None
            elif _isinstance(path, _str):
                path = _str_copy(path, _all)
            elif _isinstance(path, _bytes):
                path = _bytes_copy(path, _all).decode(fs_encoding, "surrogateescape")
            else:
                raise _PermissionError("sandbox: %s refused: pass paths as str or bytes, not %s" % (event, t.__name__))
            if ".." in path.split("/"):
                raise _PermissionError("sandbox: %s on %r refused: paths with '..' are not allowed" % (event, path))
            # Resolve symlinks (those of the system: none can be made in the scratch dir) with lstat/readlink.
            full = path if path.startswith("/") else _getcwd() + "/" + path
            todo = full.split("/")
            todo.reverse()
            real, hops = "", 0
            while todo:
                part = todo.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    real = real[: real.rfind("/")]
                    continue
                cand = real + "/" + part
                try:
                    st = _lstat(cand)
                except _OSError:
                    real = cand  # does not exist (yet): the rest is taken literally
                    continue
                if st.st_mode & 0o170000 == 0o120000:
                    hops += 1
                    if hops > 40:
                        raise _PermissionError("sandbox: %s on %r refused: too many symlinks" % (event, path))
                    target = _readlink(cand).split("/")
                    target.reverse()
                    todo.extend(target)
                    if target and target[-1] == "":  # absolute target: start again from /
                        real = ""
                else:
                    real = cand
            real = real or "/"
            inside = real == scratch or real.startswith(scratch_prefix)
            if need == WRITE:
                if not inside and not (event == "open" and real == "/dev/null"):
                    raise _PermissionError("sandbox: %s %r refused: outside the scratch directory" % (
                        "writing" if event == "open" else event + " on", path))
                continue
            if event == "open":
                try:
                    is_dir = _stat(real).st_mode & 0o170000 == 0o040000
                except _OSError:
                    is_dir = False
                if is_dir:  # a directory fd would let os.*(dir_fd=...) resolve paths this hook never sees
                    raise _PermissionError("sandbox: opening directory %r refused; use os.listdir/os.scandir" % (path,))
            if inside or roots is None:
                continue
            ok = False
            for r, rp in _zip(roots, root_prefixes):
                if real == r or real.startswith(rp):
                    ok = True
                    break
            if not ok:
                raise _PermissionError("sandbox: %s %r refused: only the scratch directory and the Python library are readable"
                                       % ("reading" if event == "open" else "listing", path))

    return hook


def _readable_roots(cfg):
    """What the code may read besides its scratch directory: the interpreter's import path (so the
    standard library imports), a few harmless device/zoneinfo files, its own /proc entry, and any
    extra paths the parent configured. None = reads are not restricted."""
    if not cfg.get("restrict_reads", True):
        return None
    roots = [os.path.realpath(p) for p in sys.path if p]
    roots += [os.path.realpath(os.path.dirname(os.__file__))]
    roots += ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/usr/share/zoneinfo", "/etc/localtime",
              "/proc/%d" % os.getpid()]
    roots += [os.path.realpath(p) for p in cfg.get("readable_paths", ())]
    return [os.path.realpath(r) for r in roots]


def _strip_unaudited():
    """Functions that signal processes or create files without an audit event: removed from every
    module that exports them (re-importing those modules is refused by the hook)."""
    import posix
    import signal

    import _signal

    # signal a process by fd; create files; change the root or namespaces (3.12+); renice, reschedule or
    # pin other processes of the same user (the worker itself)
    unaudited = ("pidfd_open", "mkfifo", "mknod", "chroot", "unshare", "setns", "setpriority",
                 "sched_setscheduler", "sched_setparam", "sched_setaffinity")
    for mod, names in ((os, unaudited), (posix, unaudited), (signal, ("pidfd_send_signal",)),
                       (_signal, ("pidfd_send_signal",))):
        for n in names:
            mod.__dict__.pop(n, None)


ISOLATION_FAILED = 111  # the parent reads this status + a "sandbox-boot:" line as "sandbox unavailable"


def _refuse(what):
    sys.stderr.write("sandbox-boot: %s\n" % what)
    sys.stderr.flush()
    os._exit(ISOLATION_FAILED)


MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE, CLONE_NEWNS = 2, 4, 0x4000, 0x40000, 0x00020000
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
EPERM = 1


def _kernel_setup(cfg):
    """The steps that need ctypes, before the code exists: (1) when the parent asked for it, mount the
    scratch tmpfs with the inode limit bubblewrap cannot set (`nr_inodes`: empty files cost kernel memory
    that no byte limit counts) and drop every capability the interpreter was started with for that (its
    own user namespace's CAP_SYS_ADMIN; nothing else will ever hold one); (2) load the parent's compiled
    seccomp filter (seccompy built it from agentloop/tools/sandbox/policy.py) with the two calls seccomp(2)
    documents: no_new_privs, then prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER); (3) without a memory
    cgroup, confirm the filter refuses the memory no rlimit counts. Loading seccompy itself here would
    cost more than the rest of the start-up; ctypes is forgotten afterwards."""
    before = set(sys.modules)
    stage = "start"
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if cfg.get("mount_scratch"):
            # A mount namespace of the interpreter's own user namespace (bubblewrap's mounts were made
            # in an outer one, whose CAP_SYS_ADMIN it never had): its mounts are copies, locked as they are.
            stage = "enter a mount namespace of its own"
            if libc.unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
            if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                raise OSError(ctypes.get_errno(), "mount(/, MS_REC|MS_PRIVATE)")
            stage = "mount the scratch tmpfs"
            opts = "size=%d,nr_inodes=%d,mode=0700" % (cfg["scratch_bytes"], cfg["scratch_inodes"])
            if libc.mount(b"tmpfs", cfg["scratch"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
                raise OSError(ctypes.get_errno(), "mount(tmpfs, %s, %s)" % (cfg["scratch"], opts))
            stage = "drop capabilities"
            for cap in range(64):  # the bounding set (needs CAP_SETPCAP: held in the root chain only)
                if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
                    break
            if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
            data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: all zero
            if libc.capset(header, data) != 0:
                raise OSError(ctypes.get_errno(), "capset(none)")
        if cfg.get("seccomp"):
            stage = "load the seccomp filter"
            program = cfg["seccomp"]

            class SockFprog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

            buf = ctypes.create_string_buffer(program, len(program))
            prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
            if cfg.get("memory_layer") == "seccomp":
                stage = "check that memory outside the address space is refused"
                got = {}
                got["shmget"] = libc.shmget(0, 4096, 0o600) == -1 and ctypes.get_errno() == EPERM  # IPC_PRIVATE
                got["memfd_create"] = libc.memfd_create(b"x", 0) == -1 and ctypes.get_errno() == EPERM
                got["msgget"] = libc.msgget(0, 0o600) == -1 and ctypes.get_errno() == EPERM
                open_ = [name for name, ok in got.items() if not ok]
                if open_:
                    _refuse("no memory cgroup, and the seccomp filter does not refuse %s" % ", ".join(open_))
    except Exception as e:
        _refuse("could not %s: %s: %s" % (stage, type(e).__name__, e))
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _exit_like_signal(signum, frame):
    """As PID 1 of its namespace the interpreter is not killed by signals it does not handle (the
    kernel's init protection): the CPU soft limit's SIGXCPU, an alarm, SIGTERM would be ignored. Exit
    with the status a shell (and bubblewrap) gives a process killed by that signal instead."""
    os._exit(128 + signum)


def _check_isolation(seccomp, scratch, scratch_inodes):
    """What the kernel reports about this process; refuse to run the code unless it is isolated."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    problems = []
    for cap in ("CapEff", "CapPrm", "CapAmb"):
        if int(status.get(cap, "1"), 16) != 0:
            problems.append("%s=%s (capabilities left)" % (cap, status.get(cap)))
    if status.get("NoNewPrivs") != "1":
        problems.append("no_new_privs not set")
    if seccomp and status.get("Seccomp") != "2":
        problems.append("seccomp filter not active (Seccomp=%s)" % status.get("Seccomp"))
    with open("/proc/self/uid_map") as f:
        maps = [line.split() for line in f if line.strip()]
    if any(int(outside) == 0 for _, outside, _ in maps):
        problems.append("uid 0 of the host is mapped into the sandbox (%s)" % maps)
    if os.getuid() == 0:
        problems.append("running as uid 0")
    with open("/proc/self/net/dev") as f:
        interfaces = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    if interfaces != ["lo"]:
        problems.append("network interfaces %s (no network namespace of its own)" % interfaces)
    if os.getpid() != 1:  # bubblewrap --as-pid-1: no process in the namespace but this filtered one
        problems.append("pid %d (no PID namespace of its own, or not its PID 1)" % os.getpid())
    scratch_super = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, fs = line.partition(" - ")
            fields = fields.split()
            where, options, fstype = fields[4], fields[5].split(","), fs.split()[0]
            if where == scratch:
                scratch_super = fs.split()[2].split(",") if len(fs.split()) > 2 else []
            if where == "/" and fstype != "tmpfs":
                problems.append("the root is the host's %s, not a minimal root" % fstype)
            writable_ok = where in (scratch, "/proc") or where.startswith(("/proc/", "/dev/"))
            if "rw" in options and not writable_ok:
                problems.append("%s is mounted read-write" % where)
    if scratch_inodes and "nr_inodes=%d" % scratch_inodes not in (scratch_super or ()):
        problems.append("the scratch tmpfs has no inode limit (%s)" % scratch_super)
    if problems:
        _refuse("isolation check failed: " + "; ".join(problems))


class _ShutilByPath:
    """Directory fds are refused (see the hook), so shutil.rmtree must walk by path (still audited per
    path): set that when the code first imports shutil, instead of importing it for every call."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "shutil":
            return None
        import _frozen_importlib_external

        sys.meta_path.remove(_ShutilByPath)
        spec = _frozen_importlib_external.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module._use_fd_functions = False

            spec.loader.exec_module = exec_module
        return spec


def _main():
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    null = os.open(os.devnull, os.O_RDONLY)
    if cfg.get("as_pid_1"):
        for sig in (signal.SIGXCPU, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGTERM, signal.SIGHUP,
                    signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, _exit_like_signal)
    _set_limits(cfg, os.getuid())
    if cfg.get("seccomp") or cfg.get("mount_scratch"):
        _kernel_setup(cfg)
    if cfg.get("require_isolation"):
        _check_isolation(cfg.get("seccomp"), cfg["scratch"], cfg.get("scratch_inodes") if cfg.get("mount_scratch") else None)
    scratch = os.path.realpath(cfg["scratch"])
    os.chdir(scratch)
    sys.path.extend(cfg.get("extra_paths", ()))
    sys.argv = ["<tool code>"]
    if cfg.get("audit_hook", True):
        sys.meta_path.insert(0, _ShutilByPath)
        readable = _readable_roots(cfg)
        _strip_unaudited()
        sys.addaudithook(_make_hook(scratch, frozenset(cfg["blocked_imports"]), readable))
    # Ready. A pre-started sandbox waits here for its one call; unused, it ends itself after idle_seconds.
    signal.alarm(cfg.get("idle_seconds") or 0)
    code = sys.stdin.read()
    signal.alarm(0)
    os.dup2(null, 0)
    os.close(null)
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main  # the code must not reach this bootstrap module's namespace
    return main.__dict__, code


def _chain(te):
    seen = []
    while te is not None and te not in seen:
        seen.append(te)
        te = te.__cause__ or te.__context__
    return seen


def _run(ns, source):
    try:
        exec(compile(source, "<tool code>", "exec"), ns)
    except SystemExit:
        raise
    except BaseException as e:  # print the traceback without this bootstrap's frame, with source lines
        sys.stdout.flush()
        try:
            import linecache
            import traceback
        except BaseException:  # the code broke the import system (e.g. replaced builtins): the bare message
            sys.stderr.write("%s: %s\n" % (type(e).__name__, e))
            sys.stderr.flush()
            os._exit(1)
        linecache.cache["<tool code>"] = (len(source), None, source.splitlines(True), "<tool code>")
        te = traceback.TracebackException(type(e), e, e.__traceback__)
        for t in _chain(te):  # the model needs its own frames, not the sandbox's
            t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename != __file__])
        print("".join(te.format()), end="", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


_run(*_main())
