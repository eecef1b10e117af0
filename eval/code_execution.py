"""Running an untrusted test program (a model-written solution and its tests) in a sandbox.

Each program runs in its own subprocess and fresh temporary directory (its working directory, HOME
and TMPDIR), with an environment of a few fixed variables, `python -I` (no user site, no PYTHON*
variables), stdin closed, and a wall-clock timeout after which its whole process group is killed.
`eval/sandbox_entry.py` runs first inside the child: resource limits, Landlock where the kernel has it (no
change to the filesystem outside the work directory), a seccomp filter (no sockets, new processes or
programs, signals to others), both whatever the program does, an audit hook, and, where the kernel allows
it, a read-only filesystem.

Isolation by the kernel is used when `unshare` (util-linux) can create user, mount, network, IPC and
pid namespaces for this process (checked once, by running a trivial program): the program then has
no network at all (a network namespace with only a down loopback), sees every mount but its work
directory read-only, and every process it starts dies with it. Where namespaces are not available
(some containers forbid them), the seccomp filter still refuses sockets, processes and signals to others,
and Landlock writes outside the work directory; on a kernel without Landlock the audit hook alone refuses
those writes, which holds for model-written code, not for code written to defeat it. `isolation()` says
which applies; results.json records it.

`run_tests` grades a function: the module runs in the sandbox and answers calls of it; the tests run
here, so the verdict is this process's own observation. `run_program` runs a whole program (passed
when it ran to its end): for programs that are not graded.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eval import value_codec
from eval.sandbox_entry import SECCOMP_DENIED, landlock_abi

log = logging.getLogger(__name__)

ENTRY = Path(__file__).with_name("sandbox_entry.py")
PASSED = b"passed"  # what sandbox_entry.py writes to stdout once the program ran to its end
NAMESPACES = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--ipc", "--pid", "--fork", "--kill-child"]
ERROR_TAIL_BYTES = 4096
SIGNAL_REASONS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit",
                  signal.SIGKILL: "killed (SIGKILL)", signal.SIGSEGV: "crashed (SIGSEGV)"}


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock; CPU time is limited to this plus one second
    memory_bytes: int = 1 << 30  # address space
    file_bytes: int = 16 << 20  # the largest file the program may write
    processes: int = 8  # RLIMIT_NPROC (the kernel exempts root from it; the audit hook refuses new processes)


@dataclass(frozen=True)
class Execution:
    status: str  # "passed", "failed" or "timed out"
    detail: str  # the last line of the program's error output, or why it was stopped

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def describe(self) -> str:
        return self.status if self.passed else f"{self.status}: {self.detail}"


def _environment(work_dir: str) -> dict:
    # numeric libraries start one thread per core unless told otherwise, which the limits would refuse
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": os.defpath, "HOME": work_dir, "TMPDIR": work_dir, "LANG": "C.UTF-8", **threads}


def _command(work_dir: str, limits: Limits, namespaces: bool, serve: str | None = None) -> list[str]:
    python = [sys.executable, "-I", "-B", str(ENTRY), "program.py", "--work-dir", work_dir,
              "--cpu-seconds", str(int(limits.timeout_s) + 1), "--memory-bytes", str(limits.memory_bytes),
              "--file-bytes", str(limits.file_bytes), "--processes", str(limits.processes),
              *(["--serve", serve] if serve else [])]
    return [*NAMESPACES, *python, "--read-only"] if namespaces else python


def _error_tail(path: Path) -> str:
    """The last non-empty line of the program's error output (the exception, for a failed test)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - ERROR_TAIL_BYTES))
        lines = f.read().decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1].strip()[:300] if lines else ""


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the program's process group (it leads its own session); only before it is reaped, so that the
    group id cannot belong to anyone else yet."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _outcome(returncode: int, stdout: bytes, stderr_file: Path) -> Execution:
    if returncode == 0 and stdout.strip() == PASSED:
        return Execution("passed", "")
    if returncode < 0:
        name = signal.Signals(-returncode)
        return Execution("failed", SIGNAL_REASONS.get(name, f"killed by {name.name}"))
    return Execution("failed", _error_tail(stderr_file) or f"stopped before its end (exit status {returncode})")


def _execute(source: str, work_dir: str, limits: Limits, namespaces: bool) -> Execution:
    work = Path(work_dir)
    (work / "program.py").write_text(source, encoding="utf-8")
    with open(work / "stderr.txt", "wb") as stderr:
        process = subprocess.Popen(_command(work_dir, limits, namespaces), cwd=work_dir, env=_environment(work_dir),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                                   start_new_session=True)
        try:
            stdout, _ = process.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            return Execution("timed out", f"still running after {limits.timeout_s:g} s")
    return _outcome(process.returncode, stdout, work / "stderr.txt")


def run_program(source: str, limits: Limits = Limits(), namespaces: bool | None = None) -> Execution:
    """Run `source` as a Python program in the sandbox; passed when it runs to its end without an exception.
    `namespaces`: None uses the kernel's isolation where available (`isolation()`); False uses only the
    in-process guard (how it runs where namespaces are unavailable)."""
    use_namespaces = namespaces_available() if namespaces is None else namespaces
    with tempfile.TemporaryDirectory(prefix="specdec-sandbox-", ignore_cleanup_errors=True) as work_dir:
        return _execute(source, os.path.realpath(work_dir), limits, use_namespaces)


def run_tests(module: str, helpers: str, tests: str, entry_point: str, limits: Limits = Limits(),
              namespaces: bool | None = None) -> Execution:
    """Grade `module`'s `entry_point` with `tests` (which define `check(candidate)`), the verdict observed here:
    the module runs in the sandbox and only answers calls of `entry_point`; `check` runs in this process
    (with `helpers`, the trusted code the tests may call, e.g. a HumanEval prompt) against a stand-in that
    sends each call there and decodes the answer (`eval/value_codec.py`). Passed when `check` returns. The
    sandboxed program can make its answers wrong or stop answering, nothing more: no exit status, file or
    output of its own counts."""
    use_namespaces = namespaces_available() if namespaces is None else namespaces
    with tempfile.TemporaryDirectory(prefix="specdec-sandbox-", ignore_cleanup_errors=True) as work_dir:
        work = Path(os.path.realpath(work_dir))
        (work / "program.py").write_text(module, encoding="utf-8")
        with open(work / "stderr.txt", "wb") as stderr:
            process = subprocess.Popen(_command(str(work), limits, use_namespaces, serve=entry_point), cwd=work,
                                       env=_environment(str(work)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=stderr, start_new_session=True)
            try:
                return _check_against(process, helpers, tests, entry_point, limits)
            finally:
                _kill_group(process)
                process.communicate()


class _Stopped(Exception):
    """The sandboxed program stopped answering: it ended, or its time ran out (`timed_out`)."""

    def __init__(self, why: str, timed_out: bool = False):
        super().__init__(why)
        self.timed_out = timed_out

    def execution(self) -> Execution:
        return Execution("timed out" if self.timed_out else "failed", f"the program {self}")


def _check_against(process: subprocess.Popen, helpers: str, tests: str, entry_point: str,
                   limits: Limits) -> Execution:
    deadline = time.monotonic() + limits.timeout_s
    answers = _Answers(process, deadline)
    try:
        first = answers.next()
    except _Stopped as stop:
        return stop.execution()
    if not first.get("ready"):
        return Execution("failed", f"the program did not load: {_error_name(first.get('error'))}")

    def candidate(*args):
        process.stdin.write((value_codec.encode(list(args)) + "\n").encode())
        process.stdin.flush()
        answer = answers.next()
        if "ok" not in answer:
            raise CandidateError(_error_name(answer.get("error")))
        return value_codec.decode(answer["ok"])

    namespace: dict = {"__name__": "__grader__"}
    try:
        exec(compile(helpers, "<helpers>", "exec"), namespace)  # noqa: S102 - the problem's own (trusted) code
        namespace[entry_point] = candidate  # tests that call the function by its name get the sandboxed one too
        exec(compile(tests, "<tests>", "exec"), namespace)  # noqa: S102
        namespace["check"](candidate)
    except _Stopped as stop:
        return stop.execution()
    except (BrokenPipeError, OSError):
        return Execution("failed", "the program stopped answering")
    except CandidateError as err:
        return Execution("failed", f"the function raised {err}")
    except Exception as err:  # noqa: BLE001 - a failed test (the tests' own message is trusted text), bounded
        return Execution("failed", f"{type(err).__name__}: {str(err)[:200]}".rstrip(": "))
    return Execution("passed", "")


def _error_name(error) -> str:
    """The exception's name from a sandboxed program's error text, and nothing else it wrote (it could hold
    anything the program can read)."""
    name = str(error or "").split(":", 1)[0].strip()
    return name if name.replace(".", "").replace("_", "").isalnum() and len(name) <= 60 else "an error"


class CandidateError(Exception):
    """A call of the sandboxed function raised (the exception named in the message) or could not answer."""


class _Answers:
    """Reply lines from the sandboxed program, each JSON, each awaited until the run's deadline."""

    def __init__(self, process: subprocess.Popen, deadline: float):
        self.stream, self.deadline, self.buffer = process.stdout, deadline, b""

    def next(self) -> dict:
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.stream], [], [], left)[0]:
                raise _Stopped("ran out of time", timed_out=True)
            chunk = os.read(self.stream.fileno(), 1 << 16)
            if not chunk:
                raise _Stopped("stopped answering")
            self.buffer += chunk
            if len(self.buffer) > value_codec.MAX_LINE_CHARS:
                raise _Stopped("answered over the size limit")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise _Stopped("answered with something else than an answer")
        return answer


@functools.cache
def _namespace_check() -> Execution | None:
    """None when `unshare` can isolate a program here, else why not (tried once per process)."""
    if shutil.which("unshare") is None:
        return Execution("failed", "the unshare command (util-linux) is not installed")
    with tempfile.TemporaryDirectory(prefix="specdec-sandbox-", ignore_cleanup_errors=True) as work_dir:
        trial = _execute("pass\n", os.path.realpath(work_dir), Limits(), namespaces=True)
    if trial.passed:
        return None
    log.warning("sandboxed programs run without kernel isolation (namespaces unavailable: %s); an audit hook "
                "refuses network, processes and writes outside their directory", trial.detail)
    return trial


def namespaces_available() -> bool:
    return _namespace_check() is None


def isolation(limits: Limits = Limits()) -> dict:
    """How programs are isolated here, for results.json."""
    failure = _namespace_check()
    kernel = ("user, mount (read-only but the work directory), network (none), IPC and pid namespaces"
              if failure is None else f"none (namespaces unavailable: {failure.detail})")
    landlock = landlock_abi()
    return {"kernel_isolation": kernel,
            "seccomp": "refuses sockets, new processes and programs, signals to other processes, ptrace, mounts, "
                       "namespaces, modules, keys, BPF, perf and io_uring" if os.uname().machine in SECCOMP_DENIED
                       else f"none (no syscall table for {os.uname().machine})",
            "landlock": f"ABI {landlock}: no filesystem change outside the work directory" if landlock
                        else "unavailable on this kernel",
            "audit_hook": "refuses processes, sockets, ctypes, rlimit changes and writes outside the work directory",
            "limits": asdict(limits)}
