"""The code a sandboxed program's interpreter runs first, then the program.

`eval.code_execution` starts this file as a script under `python -I`, in the program's fresh work
directory, so it uses the standard library only. In order:

1. With `--read-only` (it was started inside new user, mount, network and pid namespaces), every
   mount becomes read-only, nosuid and nodev except bind mounts of the work directory and of the null
   device, and the
   mounts are then locked by entering one more user namespace, so the program cannot make them
   writable again.
2. Resource limits, soft and hard: CPU time, address space, file size, open files, processes (the
   kernel does not apply this one to root; the filter and the hook below cover that case), no core files.
   Then Landlock where the kernel has it (`confine_writes`): no change to the filesystem outside the work
   directory and the null device. Then a seccomp filter (`forbid_dangerous_syscalls`): the kernel refuses
   new sockets, new programs and processes (threads stay), signals to other processes, ptrace, mounts and
   namespaces, modules, keys, BPF, perf and io_uring from here on, whatever the program does to the hook
   below.
3. An audit hook (PEP 578) refuses starting processes, sockets and name lookups, loading native code
   through ctypes, changing resource limits, and writing or removing files outside the work
   directory. Where the kernel could not isolate the program this hook is what stands between it and
   the machine: it holds for programs that do not set out to defeat it (model-written solutions and
   their tests), not for deliberately hostile code.
4. The program runs under the module name `__sandboxed__`, not `__main__` (HumanEval's reference
   harness does not run it as `__main__` either), so a solution's own `if __name__ == "__main__":`
   demo does not run. Its stdout goes to a file in the work directory; the original stdout receives
   PASSED only when the program ran to its end, so an early `exit()` cannot pass.
   With `--serve FUNCTION` (how HumanEval is graded) the program is a module: once it has run, the
   original stdout answers calls of FUNCTION read from stdin, and the grader runs the tests against
   those answers (`eval.code_execution.run_tests`): nothing this process writes is a verdict.
"""

import argparse
import ctypes
import json
import os
import resource
import runpy
import sys
import traceback
from pathlib import Path

PASSED = "passed"
# <linux/mount.h>, <fcntl.h>, <sched.h>; mount_setattr has one number on every architecture (it is newer
# than the unified syscall table)
SYS_MOUNT_SETATTR = 442
MS_BIND, MS_REC = 0x1000, 0x4000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000

REFUSED_EVENTS = frozenset({
    # processes (RLIMIT_NPROC does not bind root; a fork bomb must not get started at all)
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn",
    "os.kill", "os.killpg", "signal.pthread_kill",
    # the network, name lookups included
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "urllib.Request",
    # native code, which the hook could not see into
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    # the limits set above
    "resource.setrlimit", "resource.prlimit",
})
# events whose leading path arguments must lie inside the work directory
PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2,
               "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "os.mkfifo": 1, "os.mknod": 1,
               "os.setxattr": 1, "os.removexattr": 1, "os.chflags": 1, "shutil.rmtree": 1,
               "sqlite3.connect": 1}  # a database file is opened for writing by sqlite's own code, unseen
OPEN_FOR_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class MountAttr(ctypes.Structure):  # struct mount_attr
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _checked(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: cannot {what}: {os.strerror(errno)}")


def _set_mount_attributes(libc, path: bytes, flags: int, attributes: MountAttr) -> None:
    _checked(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path, ctypes.c_uint(flags),
                          ctypes.byref(attributes), ctypes.c_size_t(ctypes.sizeof(attributes))),
             f"set the attributes of mount {path.decode()}")


def make_filesystem_read_only(work_dir: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    work = os.fsencode(work_dir)
    # the work directory as a mount of its own, so that it can stay writable under a read-only root; the
    # null device too, so that code that discards output through it still runs
    null = os.fsencode(os.devnull)
    _checked(libc.mount(work, work, None, MS_BIND | MS_REC, None), "bind-mount the work directory")
    _checked(libc.mount(null, null, None, MS_BIND, None), "bind-mount the null device")
    _set_mount_attributes(libc, b"/", AT_RECURSIVE,
                          MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV))
    _set_mount_attributes(libc, work, 0, MountAttr(attr_clr=MOUNT_ATTR_RDONLY))
    _set_mount_attributes(libc, null, 0, MountAttr(attr_clr=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV))
    # mounts copied into a mount namespace that a new user namespace owns are locked there
    _checked(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "lock the mounts")
    os.chdir(work_dir)  # the working directory still pointed into the (now read-only) mount below the bind


# seccomp (<linux/seccomp.h>, <linux/filter.h>, <linux/audit.h>): syscalls the program never needs, per
# architecture (the numbers differ): new sockets of any kind (the host's UNIX sockets included), new programs
# and processes (threads stay), debugging or reading other processes, mounts and namespaces, kernel modules
# and keys, BPF, perf and io_uring (whose operations seccomp would not see). They fail with EPERM; clone3,
# whose flags a filter cannot read, fails with ENOSYS, so that glibc creates threads with clone instead.
SECCOMP_DENIED = {
    "x86_64": (0xC000003E, dict(
        socket=41, execve=59, execveat=322, fork=57, vfork=58, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        init_module=175, finit_module=313, delete_module=176, kexec_load=246, kexec_file_load=320, add_key=248,
        request_key=249, keyctl=250, bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, pidfd_send_signal=424),
        dict(clone=56, clone3=435, kill=62, tkill=200, tgkill=234)),
    "aarch64": (0xC00000B7, dict(
        socket=198, execve=221, execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271, mount=40,
        umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, open_tree=428, move_mount=429, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, init_module=105, finit_module=273,
        delete_module=106, kexec_load=104, kexec_file_load=294, add_key=217, request_key=218, keyctl=219, bpf=280,
        perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
        pidfd_send_signal=424),
        dict(clone=220, clone3=435, kill=129, tkill=130, tgkill=131)),
}
X32_SYSCALL_BIT = 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM, ENOSYS = 1, 38
CLONE_THREAD = 0x00010000
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, JSET, BPF_RET|K
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (the low half of args[0] on little-endian machines)


class SockFilter(ctypes.Structure):  # struct sock_filter
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_program(arch: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions: another architecture's syscalls kill the process; a denied
    syscall fails; clone only makes threads; signals go only to this process (`pid`)."""
    audit_arch, denied, special = SECCOMP_DENIED[arch]
    program = [(LD_ABS_W, 0, 0, ARCH), (JEQ, 1, 0, audit_arch), (RET, 0, 0, RET_KILL_PROCESS), (LD_ABS_W, 0, 0, NR)]
    if arch == "x86_64":  # the x32 ABI's numbers would bypass the table
        program += [(JGE, 0, 1, X32_SYSCALL_BIT), (RET, 0, 0, RET_KILL_PROCESS)]
    for number in denied.values():
        program += [(JEQ, 0, 1, number), (RET, 0, 0, RET_ERRNO | EPERM)]
    program += [(JEQ, 0, 1, special["clone3"]), (RET, 0, 0, RET_ERRNO | ENOSYS)]
    # clone: allowed with CLONE_THREAD in its flags; kill, tkill, tgkill: allowed at this process only
    program += [(JEQ, 0, 4, special["clone"]), (LD_ABS_W, 0, 0, ARG0), (JSET, 0, 1, CLONE_THREAD),
                (RET, 0, 0, RET_ALLOW), (RET, 0, 0, RET_ERRNO | EPERM)]
    for name in ("kill", "tkill", "tgkill"):
        program += [(LD_ABS_W, 0, 0, NR), (JEQ, 0, 4, special[name]), (LD_ABS_W, 0, 0, ARG0), (JEQ, 0, 1, pid),
                    (RET, 0, 0, RET_ALLOW), (RET, 0, 0, RET_ERRNO | EPERM)]
    return program + [(RET, 0, 0, RET_ALLOW)]


def forbid_dangerous_syscalls() -> bool:
    """Install the seccomp filter (kept by every thread, irreversible); False on an architecture without a table
    (then the audit hook and, where available, the namespaces are what is left)."""
    arch = os.uname().machine
    if arch not in SECCOMP_DENIED:
        return False
    program = seccomp_program(arch, os.getpid())
    filters = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    libc = ctypes.CDLL(None, use_errno=True)
    _checked(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "forbid new privileges")
    _checked(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(SockFprog(len(program), filters)), 0, 0),
             "install the seccomp filter")
    return True


# Landlock (<linux/landlock.h>; one syscall number on every architecture): the filesystem rights that change
# something, each handled by the kernel versions that know it (ABI 1, 2: refer, 3: truncate, 5: device ioctl)
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_WRITE_FILE, FS_TRUNCATE = 1 << 1, 1 << 14
FS_CHANGES = {1: sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12)), 2: 1 << 13, 3: FS_TRUNCATE, 5: 1 << 15}


class PathBeneath(ctypes.Structure):  # struct landlock_path_beneath_attr (packed)
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock version (0: none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return max(0, libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                               ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)))


def confine_writes(work_dir: str) -> bool:
    """Landlock: from here on the kernel refuses every change to the filesystem (writing, creating, removing,
    renaming, truncating) but inside the work directory and writing the null device; False where the kernel
    has no Landlock (the audit hook, and in the namespace mode the read-only mounts, remain)."""
    abi = landlock_abi()
    if abi < 1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    handled = sum(rights for version, rights in FS_CHANGES.items() if abi >= version)
    ruleset = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(ctypes.c_uint64(handled)),
                           ctypes.c_size_t(8), ctypes.c_uint32(0))  # the attribute's first field: fs rights
    _checked(0 if ruleset >= 0 else -1, "create a Landlock ruleset")
    try:
        for path, allowed in ((work_dir, handled), (os.devnull, handled & (FS_WRITE_FILE | FS_TRUNCATE))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                _checked(libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ruleset, LANDLOCK_RULE_PATH_BENEATH,
                                      ctypes.byref(PathBeneath(allowed, fd)), ctypes.c_uint32(0)),
                         f"allow changes under {path}")
            finally:
                os.close(fd)
        _checked(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "forbid new privileges")
        _checked(libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ruleset, ctypes.c_uint32(0)),
                 "restrict the filesystem")
    finally:
        os.close(ruleset)
    return True


def limit_resources(args) -> None:
    limits = [(resource.RLIMIT_CPU, args.cpu_seconds), (resource.RLIMIT_AS, args.memory_bytes),
              (resource.RLIMIT_FSIZE, args.file_bytes), (resource.RLIMIT_NOFILE, 64),
              (resource.RLIMIT_NPROC, args.processes), (resource.RLIMIT_CORE, 0)]
    for limit, value in limits:
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def install_guard(work_dir: str) -> None:
    """The audit hook. Everything it consults is bound here, when it is installed: a program that rebinds
    this module's globals or the os module's functions afterwards changes nothing it checks (code out to
    defeat it can still reach its closure through the garbage collector: see the module's docstring)."""
    work_dir = os.path.realpath(work_dir)
    refused, path_events, writing = frozenset(REFUSED_EVENTS), dict(PATH_EVENTS), OPEN_FOR_WRITING
    realpath, commonpath, fsdecode, devnull = os.path.realpath, os.path.commonpath, os.fsdecode, os.devnull

    def inside(path) -> bool:
        """Whether the program may write to `path`: inside its work directory, or the null device."""
        if isinstance(path, int):  # an open file descriptor: opening it was checked
            return True
        resolved = realpath(fsdecode(path))
        return resolved == devnull or commonpath([resolved, work_dir]) == work_dir

    def guard(event: str, args: tuple) -> None:
        if event in refused:
            raise PermissionError(f"{event} is refused in the sandbox")
        if event == "open" and args[2] & writing and not inside(args[0]):
            raise PermissionError(f"writing {args[0]!r} is refused in the sandbox (outside its directory)")
        paths = path_events.get(event, 0)
        if any(not inside(path) for path in args[:paths] if path is not None):
            raise PermissionError(f"{event} {args[:paths]!r} is refused in the sandbox (outside its directory)")

    sys.addaudithook(guard)


def _own_stdout():
    """The original stdout, kept for this runner's own lines; the program's stdout goes to a file of the work
    directory."""
    kept = os.fdopen(os.dup(1), "w")
    own_stdout = os.open("stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(own_stdout, 1)
    os.close(own_stdout)
    return kept


def run(program: str) -> int:
    verdict = _own_stdout()
    try:
        runpy.run_path(program, run_name="__sandboxed__")
    except SystemExit as exit_:
        print(f"SystemExit({exit_.code!r}): the program exited before its end", file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    sys.stdout.flush()
    verdict.write(PASSED)
    verdict.flush()
    return 0


def serve(program: str, entry_point: str) -> int:
    """Run the program (a module defining `entry_point`), then answer calls of that function: one request per
    line on stdin (its encoded arguments), one reply per line on the original stdout ({"ok": result} or
    {"error": why}). The grader runs the tests and judges the answers; nothing written here is a verdict."""
    codec = _load_codec()
    replies = _own_stdout()

    def reply(**message) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    try:
        function = runpy.run_path(program, run_name="__sandboxed__")[entry_point]
    except BaseException as err:  # noqa: BLE001 - whatever stops the module from loading fails the program
        traceback.print_exc()
        reply(error=f"the program did not load: {type(err).__name__}")
        return 1
    reply(ready=True)
    for line in sys.stdin:
        try:
            result = function(*codec.decode(line))
            reply(ok=codec.encode(result))
        except BaseException as err:  # noqa: BLE001 - the call's failure is the answer
            reply(error=f"{type(err).__name__}: {str(err)[:200]}")
    return 0


def _load_codec():
    """eval/value_codec.py beside this file (the interpreter runs isolated: no package path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("value_codec", Path(__file__).with_name("value_codec.py"))
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    return codec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="run a program in the sandbox (started by eval.code_execution)")
    p.add_argument("program", help="the program file, inside the work directory")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--read-only", action="store_true", help="make every mount but the work directory read-only "
                                                            "(inside user and mount namespaces)")
    p.add_argument("--cpu-seconds", type=int, required=True)
    p.add_argument("--memory-bytes", type=int, required=True)
    p.add_argument("--file-bytes", type=int, required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--serve", metavar="FUNCTION", help="after the program, answer calls of FUNCTION (see serve)")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.read_only:
        make_filesystem_read_only(args.work_dir)
    limit_resources(args)
    confine_writes(args.work_dir)
    forbid_dangerous_syscalls()
    install_guard(args.work_dir)
    return serve(args.program, args.serve) if args.serve else run(args.program)


if __name__ == "__main__":
    sys.exit(main())
