"""The seccomp policy of the kernel sandbox: which system calls model-written code may not make.

Default allow, then deny (EPERM, or ENOSYS for `clone3` so glibc falls back to `clone`, which can be
inspected): new processes and programs (`fork`, `vfork`, `clone` without CLONE_THREAD or with any
namespace flag, `execve`, `execveat`), other processes' memory and state (`ptrace`, `process_vm_*`,
`pidfd_*`, `kcmp`, `perf_event_open`), namespaces and mounts (`unshare`, `setns`, `mount`, the new
mount API, `pivot_root`, `chroot`), kernel facilities that are attack surface and never needed to run
Python (`bpf`, `keyctl` and friends, module loading, `kexec`, `io_uring` — which also runs I/O that
seccomp never sees —, `userfaultfd`, handle-based opens, clocks, swap, reboot, ...) and sockets of any
family but AF_UNIX (asyncio needs a socketpair; the network namespace is empty anyway).
Without a memory cgroup (`cgroup.py`) the filter also refuses the memory that no rlimit counts
(`MEMORY_ESCAPES`: SysV shared memory and message queues, memfd, POSIX message queues): pages a cgroup
would charge to the call, but that the address-space limit never sees.
Foreign ABIs (i386 via int 0x80) are killed by seccompy's architecture check; x32 numbers of the
denied calls are denied too, for kernels built with the x32 ABI.

The rules are data (`seccomp_rules`) so they can be read and tested; `compiled_filter` turns them into the
BPF program with seccompy (once per worker), and the sandbox's boot script loads that program before any
model code runs.
"""

from __future__ import annotations

import errno
import functools

__all__ = ["DENIED_SYSCALLS", "MEMORY_ESCAPES", "compiled_filter", "seccomp_rules"]

CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
AF_UNIX = 1
X32_SYSCALL_BIT = 0x40000000
# x32-only syscall numbers (512..547: the compat entry points, execve and ptrace among them)
X32_ONLY = range(512, 548)
MASKED_EQ, NE = 6, 1  # seccompy.CmpOp values

DENIED_SYSCALLS = (
    # processes and programs
    "fork", "vfork", "execve", "execveat",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
    "kcmp", "perf_event_open", "process_madvise",
    # namespaces, mounts, roots
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "open_tree_attr",
    # kernel attack surface, privileged or never needed by Python code
    "bpf", "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd", "ioperm",
    "iopl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "lookup_dcookie", "uselib", "vhangup", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init", "personality", "mbind", "set_mempolicy",
    "migrate_pages", "move_pages", "memfd_secret",
)

# Memory outside RLIMIT_AS: SysV shm segments and message queues (kernel memory of the IPC namespace that
# outlives any detach), memfd (shmem pages held by an fd), POSIX message queues. Refused when no memory
# cgroup charges them to the call.
MEMORY_ESCAPES = ("shmget", "shmat", "msgget", "msgsnd", "memfd_create", "mq_open")


Rule = tuple[int, int, list[tuple[int, int, int, int]]]


def _nr(name: str) -> int | None:
    import seccompy

    try:
        return seccompy.syscall_nr(name)
    except ValueError:  # not a syscall of this architecture (e.g. `fork` on aarch64)
        return None


def seccomp_rules(memory_cgroup: bool = True) -> list[Rule]:
    """(syscall number, errno, [(arg index, seccompy.CmpOp, value, mask)]) for the native architecture, in
    match order: the first rule of a syscall whose conditions hold decides; anything else is allowed.
    `memory_cgroup` False: the call has no memory cgroup, so `MEMORY_ESCAPES` are refused too."""
    import seccompy

    full = (1 << 64) - 1
    rules: list[Rule] = []
    names = DENIED_SYSCALLS if memory_cgroup else DENIED_SYSCALLS + MEMORY_ESCAPES
    denied = [nr for nr in map(_nr, names) if nr is not None]
    rules += [(nr, errno.EPERM, []) for nr in denied]
    clone, clone3 = _nr("clone"), _nr("clone3")
    if clone is not None:
        # a thread that would also enter a new namespace, then a new process (no CLONE_THREAD)
        rules += [(clone, errno.EPERM, [(0, MASKED_EQ, flag, flag)]) for flag in NAMESPACE_FLAGS]
        rules.append((clone, errno.EPERM, [(0, MASKED_EQ, 0, CLONE_THREAD)]))
    if clone3 is not None:
        rules.append((clone3, errno.ENOSYS, []))  # its flags live in memory that seccomp cannot read
    sockets = [nr for nr in map(_nr, ("socket", "socketpair")) if nr is not None]
    rules += [(nr, errno.EPERM, [(0, NE, AF_UNIX, full)]) for nr in sockets]
    if seccompy.arch() == "x86_64":  # the x32 ABI shares the architecture tag: deny its numbers outright
        x32 = {nr | X32_SYSCALL_BIT for nr in [*denied, *sockets, clone, clone3] if nr is not None}
        x32.update(n | X32_SYSCALL_BIT for n in X32_ONLY)
        rules += [(nr, errno.EPERM, []) for nr in sorted(x32)]
    return rules


@functools.lru_cache(maxsize=2)
def compiled_filter(memory_cgroup: bool = True) -> bytes:
    """The policy as a seccomp BPF program (packed `struct sock_filter`s) for the native architecture:
    foreign architectures are killed, the rules above return their errno, everything else is allowed."""
    import seccompy

    filt = seccompy.Filter(default=seccompy.Action.ALLOW)
    for nr, err, conds in seccomp_rules(memory_cgroup):
        filt.errno(nr, err, args=[seccompy.ArgCmp(*c) for c in conds] or None)
    return filt.program
