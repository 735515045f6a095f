"""Bootstrap of the `python` tool's child interpreter (run as `python -I -S -B -u _sandbox_boot.py CONFIG`).

It is the first code in the child and uses only the standard library. In order, it:
1. reads the model's code from stdin (then stdin is /dev/null),
2. sets resource limits with hard == soft (CPU seconds, address space, processes, file size, open
   files, no core dumps) so the code cannot raise them (raising is also refused by the hook below),
3. drops to an unprivileged uid/gid when the parent asked for it (parent runs as root),
4. enters the scratch directory,
5. installs an audit hook (PEP 578; a hook cannot be removed once added) that refuses:
   - opening a file for writing, or any path-changing os call (mkdir, remove, rename, link, chmod, ...),
     outside the scratch directory (paths are resolved with realpath; paths with ".." and creating
     symlinks are refused, so no check-then-use race with another thread can escape),
   - reading or listing anything but the scratch directory, the interpreter's import path and a few
     harmless files (unless the parent turned `restrict_reads` off): no secrets from /proc/*/environ,
     home directories or configs reach the model,
   - opening directories (a directory fd would let `os.*(dir_fd=...)` resolve paths the hook never sees),
   - chdir out of the scratch directory,
   - creating processes (fork, exec, spawn, system, subprocess), signalling processes, changing limits,
   - every socket operation, and importing socket/ssl/ctypes/_posixsubprocess/gc/sqlite3/dbm/... (ctypes
     could patch the interpreter's memory and gc could find the hook function; sqlite3/dbm write files
     from C without an "open" event),
   and it strips the unaudited `pidfd_open`/`pidfd_send_signal`/`mkfifo`/`mknod`/`chroot` from os/posix/signal,
6. runs the code as `__main__` in a fresh module namespace.

Audit hooks are not a sandbox against native code, which is why ctypes is refused and why the parent
adds OS-level layers (rlimits, a new network namespace when `unshare` works, a process-group kill).
"""

import json
import os
import resource
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
    """The audit hook. Everything it needs is bound here (no module globals the code could reach)."""
    sep = os.sep
    realpath, isdir, fsdecode, readlink = os.path.realpath, os.path.isdir, os.fsdecode, os.readlink
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked_events = frozenset((
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "pty.spawn",
    ))
    blocked_prefixes = ("socket.", "ctypes.", "_posixsubprocess.", "sqlite3.", "dbm.")
    # event -> how many leading arguments are paths that the call changes
    mutating = {"os.mkdir": 1, "os.rmdir": 1, "os.remove": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
                "os.truncate": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
                "os.rename": 2, "os.link": 2}
    roots = tuple(readable) if readable is not None else None

    def under(real, root):
        return real == root or real.startswith(root if root.endswith(sep) else root + sep)

    def inside(path):
        if isinstance(path, int):  # f-functions (fchmod, futimes, ...): judge the file the fd refers to
            if path < 0:
                return True
            try:
                path = readlink("/proc/self/fd/%d" % path)
            except OSError:
                return False
        path = fsdecode(path)
        return ".." not in path.split(sep) and under(realpath(path), scratch)

    def may_read(path):
        if isinstance(path, int):
            return True
        path = fsdecode(path)
        if ".." in path.split(sep):
            return False
        real = realpath(path)
        return under(real, scratch) or any(under(real, r) for r in roots)

    def deny(what):
        raise PermissionError("sandbox: " + what)

    # Why ".." and symlinks are refused: the hook checks a path, then the call resolves it again. With
    # no symlinks in the scratch directory and no "..", a path that is inside at check time stays inside
    # even if another thread renames directories in between (renames are confined to the scratch dir).
    def hook(event, args):
        if event == "import":
            mod = args[0]
            # Every component: an extension's init symbol comes from the last one ("x._socket").
            if any(part in blocked_imports for part in mod.split(".")):
                raise ImportError("sandbox: import of %r is not allowed (no network, processes, ctypes or gc)" % mod)
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing:
                if not inside(path) and realpath(fsdecode(path)) != "/dev/null":
                    deny("writing %r refused: outside the scratch directory" % fsdecode(path))
            elif isdir(path):
                deny("opening directory %r refused; use os.listdir/os.scandir" % fsdecode(path))
            elif roots is not None and not may_read(path):
                deny("reading %r refused: only the scratch directory and the Python library are readable" % fsdecode(path))
        elif event in ("os.listdir", "os.scandir"):
            if args[0] is not None and not may_read(args[0] if args[0] != "" else "."):
                deny("listing %r refused: outside the scratch directory and the Python library" % fsdecode(args[0]))
        elif event in blocked_events or event.startswith(blocked_prefixes):
            deny(event + " refused: no processes, signals, limit changes, databases or network in the sandbox")
        elif event == "os.chdir":
            if not inside(args[0]):
                deny("chdir to %r refused: outside the scratch directory" % fsdecode(args[0]))
        elif event == "os.symlink":
            deny("creating symlinks is not allowed in the sandbox")
        elif event in mutating:
            for p in args[: mutating[event]]:
                if not inside(p):
                    deny("%s on %r refused: outside the scratch directory" % (event, fsdecode(p)))

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

    # signal a process by fd; create files; change the root or namespaces (3.12+)
    unaudited = ("pidfd_open", "mkfifo", "mknod", "chroot", "unshare", "setns")
    for mod, names in ((os, unaudited), (posix, unaudited), (signal, ("pidfd_send_signal",)),
                       (_signal, ("pidfd_send_signal",))):
        for n in names:
            mod.__dict__.pop(n, None)


def _main():
    cfg = json.loads(sys.argv[1])
    code = sys.stdin.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    uid = cfg.get("uid")
    _set_limits(cfg, uid if uid is not None else os.getuid())
    if uid is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(uid)
    scratch = os.path.realpath(cfg["scratch"])
    os.chdir(scratch)
    sys.argv = ["<tool code>"]
    import shutil

    # Directory fds are refused (see the hook), so rmtree must walk by path (still audited per path).
    shutil._use_fd_functions = False
    readable = _readable_roots(cfg)
    _strip_unaudited()
    sys.addaudithook(_make_hook(scratch, frozenset(cfg["blocked_imports"]), readable))
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
        import linecache
        import traceback

        linecache.cache["<tool code>"] = (len(source), None, source.splitlines(True), "<tool code>")
        te = traceback.TracebackException(type(e), e, e.__traceback__)
        for t in _chain(te):  # the model needs its own frames, not the sandbox's
            t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename != __file__])
        print("".join(te.format()), end="", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


_run(*_main())
