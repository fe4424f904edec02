"""
Running code a model wrote (HumanEval answers) without trusting it.

The program runs under bubblewrap (`bwrap`, Debian/Ubuntu package `bubblewrap`) in:
  - its own mount namespace: the whole file system read-only, a private empty /tmp, and one
    writable working directory, a fresh temporary directory deleted afterwards;
  - its own network namespace (no interface but a downed loopback: no network at all, also when
    the caller is not root), and its own PID, IPC and UTS namespaces;
  - an empty environment (HOME, TMPDIR and PATH only);
  - resource limits set by a trusted launcher before the program starts: address space, number
    of processes, file size and CPU time. As root the launcher first drops to the unprivileged
    user `nobody` (65534), since the kernel never applies a process limit to root.
On a timeout the whole process group is killed, and with it the PID namespace: no grandchild
outlives the run.

    result = run_untrusted("print(1 + 1)", timeout=5)   # result.returncode, result.stdout
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
PYTHON_HOME = "/tmp/python"  # where the interpreter's prefix is mounted inside (readable by nobody)
WORK = "/tmp/work"  # the writable working directory, inside

# Runs inside the sandbox before the untrusted program: limits first, then (as root) the
# unprivileged user, then the program itself, in this same process.
LAUNCHER = """
import os, resource, sys
memory, file_size, cpu_seconds, processes = (int(a) for a in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(%d)
    os.setuid(%d)
sys.argv = ["prog.py"]
source = open("prog.py").read()
del memory, file_size, cpu_seconds, processes, resource
exec(compile(source, "prog.py", "exec"), {"__name__": "__main__"})
""" % (NOBODY, NOBODY)


class SandboxError(RuntimeError):
    """The sandbox cannot be set up here; the message says what to install or change."""


@dataclass
class Result:
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool


def bwrap_command(work: Path) -> list:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("running model-written code needs bubblewrap to isolate it: "
                           "apt-get install bubblewrap (or your system's package of it)")
    root = os.geteuid() == 0
    cmd = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
           "--ro-bind", sys.base_prefix, PYTHON_HOME, "--bind", str(work), WORK, "--chdir", WORK,
           "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--clearenv",
           "--setenv", "HOME", WORK, "--setenv", "TMPDIR", WORK, "--setenv", "PATH", "/usr/bin:/bin"]
    if root:  # bwrap drops every capability of a privileged caller; the launcher needs these two
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user"]
    executable = Path(sys._base_executable).resolve().relative_to(Path(sys.base_prefix).resolve())
    python = Path(PYTHON_HOME) / executable  # the interpreter itself, not a virtualenv's link to it
    return cmd + [str(python), "-I", "-c", LAUNCHER]


def user_processes() -> int:
    """How many processes the calling user runs now: RLIMIT_NPROC counts all of them."""
    uid, count = os.getuid(), 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            count += any(line.split()[1] == str(uid) for line in status.read_text().splitlines()
                         if line.startswith("Uid:"))
        except OSError:
            pass
    return count


def run_untrusted(source: str, timeout: float = 10.0, memory_bytes: int = 2 << 30, file_bytes: int = 16 << 20,
                  processes: int = 32, cpu_seconds: int | None = None) -> Result:
    """Run Python `source` in the sandbox; at most `processes` processes of its own, `timeout`
    seconds of wall time and `cpu_seconds` (default: the timeout, rounded up) of CPU time."""
    cpu_seconds = cpu_seconds or int(timeout) + 1
    # as nobody the program owns no process yet; otherwise the user's own count is in the limit
    nproc = processes if os.geteuid() == 0 else user_processes() + processes
    with tempfile.TemporaryDirectory(prefix="vat-sandbox-") as work:
        work = Path(work)
        work.chmod(0o777)  # writable by nobody
        (work / "prog.py").write_text(source)
        cmd = bwrap_command(work) + [str(memory_bytes), str(file_bytes), str(cpu_seconds), str(nproc)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env={})
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap and its PID namespace, grandchildren included
            out, err = proc.communicate()
            timed_out = True
    stderr = err.decode(errors="replace")
    if proc.returncode == 1 and stderr.startswith("bwrap:"):
        raise SandboxError(f"bubblewrap could not build the sandbox: {stderr.strip().splitlines()[0]}")
    return Result(proc.returncode, out.decode(errors="replace"), stderr, timed_out)


def check_sandbox():
    """Fail now, with the reason, if the sandbox cannot run here (before hours of generation)."""
    r = run_untrusted("print('ok')", timeout=30)
    if r.stdout.strip() != "ok":
        raise SandboxError(f"the sandbox ran, but a test program failed: {r.stderr.strip()[-300:]}")
