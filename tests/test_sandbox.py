"""sandbox.py: each limit holds against a program written to break it."""
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import needs_bwrap

from sandbox import run_untrusted

pytestmark = needs_bwrap


def test_a_plain_program_runs_and_reports():
    r = run_untrusted("import sys; print('hello'); sys.exit(3)")
    assert (r.returncode, r.stdout, r.timed_out) == (3, "hello\n", False)


def test_environment_is_empty(monkeypatch):
    monkeypatch.setenv("VAT_TEST_SECRET", "hunter2")
    r = run_untrusted(f"""
import os
print(sorted(os.environ))
try:
    print(open('/proc/{os.getpid()}/environ').read())  # the caller's environment, by its PID
except OSError:
    print('unreadable')
""")
    names = eval(r.stdout.splitlines()[0])
    assert set(names) <= {"HOME", "TMPDIR", "PATH", "PWD", "LC_CTYPE"} and "hunter2" not in r.stdout
    assert r.stdout.splitlines()[1] == "unreadable"


def test_no_writes_outside_its_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_untrusted(f"""
open('inside.txt', 'w').write('ok')
print(open('inside.txt').read())
for path in [{str(target)!r}, {str(Path.home() / ('vat-escape-' + uuid.uuid4().hex))!r}, '/etc/vat-escape']:
    try:
        open(path, 'w').write('gotcha')
        print('wrote', path)
    except OSError as e:
        print('refused', e.errno)
""")
    assert r.stdout.splitlines()[0] == "ok"
    assert "wrote" not in r.stdout and r.stdout.count("refused") == 3
    assert not target.exists() and not Path("/etc/vat-escape").exists()


def test_no_network_not_even_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        r = run_untrusted(f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2)
    print('connected')
except OSError as e:
    print('refused', e.errno)
""")
        assert r.stdout.startswith("refused"), r.stdout + r.stderr
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody knocked


def test_process_limit_holds():
    r = run_untrusted("""
import os, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    n += 1
print(n)
""", processes=16, timeout=20)
    assert int(r.stdout) < 16


def test_memory_file_size_and_cpu_limits():
    r = run_untrusted("""
try:
    x = bytearray(3 << 30)
    print('allocated')
except MemoryError:
    print('memory refused')
try:
    open('big', 'wb').write(b'0' * (32 << 20))
    print('wrote')
except OSError as e:
    print('file refused', e.errno)
""", memory_bytes=1 << 30, file_bytes=8 << 20)
    assert r.stdout.split("\n")[:2] == ["memory refused", "file refused 27"], r.stdout + r.stderr  # 27: EFBIG
    r = run_untrusted("while True: pass", timeout=30, cpu_seconds=1)
    assert r.returncode != 0 and not r.timed_out  # the CPU limit, not the 30 s timeout, ended it


def test_timeout_kills_grandchildren():
    marker = uuid.uuid4().hex
    r = run_untrusted(f"""
import os, subprocess, sys, time
# a grandchild in a session of its own, as a program hiding from a process-group kill would make
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', '{marker}'], start_new_session=True)
time.sleep(120)
""", timeout=3)
    assert r.timed_out
    survivors = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                survivors.append(cmdline.parent.name)
        except OSError:
            pass
    assert survivors == []


SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not SYSTEM_PYTHON.exists(),
                    reason="needs root (to become nobody), setpriv and a system Python nobody can run")
def test_the_same_limits_hold_for_an_unprivileged_caller():
    """As a user that is not root, bwrap runs in a user namespace and nothing drops privileges:
    run the sandbox itself as nobody and check network, writes and processes again."""
    tmp_path = Path(tempfile.mkdtemp(prefix="vat-nobody-"))  # pytest's own tmp_path is root's alone
    tmp_path.chmod(0o777)
    (tmp_path / "sandbox.py").write_text((Path(__file__).parent.parent / "experiments" / "sandbox.py").read_text())
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        hostile = f"""
import os, socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError:
    print("no network")
try:
    open({str(tmp_path / "escaped")!r}, "w").write("x")
    print("wrote")
except OSError:
    print("no write")
n = 0
for _ in range(100):
    try:
        if os.fork() == 0:
            import time
            time.sleep(3)
            os._exit(0)
        n += 1
    except OSError:
        break
print(n)
"""
        caller = f"import sandbox; r = sandbox.run_untrusted({hostile!r}, processes=16); print(r.stdout, end='')"
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(SYSTEM_PYTHON),
                            "-c", caller], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = r.stdout.split()
    escaped = (tmp_path / "escaped").exists()
    shutil.rmtree(tmp_path)
    assert lines[:4] == ["no", "network", "no", "write"], r.stdout + r.stderr
    assert int(lines[4]) < 16 and not escaped
