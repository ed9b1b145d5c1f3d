"""Sandbox: correct/wrong programs, limits (time, memory, processes, output), refused escapes
(files, network, secrets), forged results, the worker pool, and real HumanEval problems."""

import json
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path

import pytest

from hybridlm.data import builtin
from hybridlm.rl.sandbox import Sandbox, SandboxConfig, StdioTest, namespace_support

CONFIG = SandboxConfig(timeout_s=10.0)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(CONFIG, max_workers=2)


def test_correct_passes_wrong_fails(sandbox):
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    good = sandbox.run("def add(a, b):\n    return a + b\n", tests)
    assert good.status == "ok" and good.passed and good.pass_rate == 1.0
    assert [t.passed for t in good.tests] == [True, True]
    bad = sandbox.run("def add(a, b):\n    return a - b\n", tests)
    assert bad.status == "failed" and not bad.passed
    assert [t.passed for t in bad.tests] == [False, True] and bad.pass_rate == 0.5
    assert "AssertionError" in bad.tests[0].error
    broken = sandbox.run("def add(a, b)\n    return a + b\n", tests)
    assert broken.status == "error" and "SyntaxError" in broken.reason and broken.pass_rate == 0.0
    raises = sandbox.run("raise KeyError('boom')", tests)
    assert raises.status == "error" and "KeyError" in raises.reason


def test_stdio_tests(sandbox):
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    cases = [
        StdioTest(stdin="1 2\n", expected_stdout="3"),
        StdioTest(stdin="5 5", expected_stdout="11"),
    ]
    r = sandbox.run(prog, cases)
    assert r.status == "failed" and [t.passed for t in r.tests] == [True, False]
    assert "10" in r.tests[1].error


def test_forged_results_do_not_pass(sandbox):
    fake = json.dumps({"token": "0" * 32, "kind": "done", "status": "ok"})
    for prog in (
        f"print({fake!r})\nimport os\nos._exit(0)",  # fake record, then skip the tests
        "import sys\nsys.exit(0)",  # leave before the tests run
        "import os\nos._exit(0)",
    ):
        r = sandbox.run(prog, ["assert False"])
        assert r.status == "error" and not r.passed, (prog, r)


def test_infinite_loop_times_out_within_limit():
    sb = Sandbox(SandboxConfig(timeout_s=1.0))
    t0 = time.monotonic()
    r = sb.run("while True:\n    pass\n", ["assert True"])
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and not r.passed
    assert 1.0 <= r.runtime_s < 2.5 and elapsed < 3.5


def _sandbox_processes() -> list[int]:
    """Host pids whose working directory is a sandbox work dir (live or deleted)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and "hybridlm-sandbox-" in os.readlink(f"/proc/{d}/cwd"):
                pids.append(int(d))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("hook", [True, False])
def test_fork_bomb_is_bounded(hook):
    """With the audit hook fork is refused; without it the process limit (RLIMIT_NPROC for a
    dropped uid, a pids cgroup for root) stops the bomb and the PID namespace / process group
    kill leaves nothing behind."""
    sb = Sandbox(SandboxConfig(timeout_s=5.0, max_processes=16, audit_hook=hook))
    if not hook and not ({"uid", "pids_cgroup"} & set(sb.layers) or os.geteuid() != 0):
        pytest.skip("root without a pids cgroup or uid drop: nothing bounds fork below the hook")
    r = sb.run("import os\nwhile True:\n    os.fork()\n", ["assert True"])
    assert r.status in ("killed", "error") and not r.passed
    assert r.runtime_s < 5.0
    if hook:
        assert "os.fork is not allowed" in r.reason
    else:
        assert r.status == "killed" and "process limit" in r.reason
    deadline = time.monotonic() + 5.0
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []  # the machine survives: no leftover bomb processes
    again = sb.run("x = 1", ["assert x == 1"])
    assert again.passed


def test_threads_count_against_the_process_limit():
    sb = Sandbox(SandboxConfig(timeout_s=5.0, max_processes=8))
    if os.geteuid() == 0 and not {"uid", "pids_cgroup"} & set(sb.layers):
        pytest.skip("root without a pids cgroup or uid drop")
    prog = (
        "import threading, time\n"
        "ts = [threading.Thread(target=time.sleep, args=(1,)) for _ in range(64)]\n"
        "for t in ts:\n    t.start()\n"
    )
    r = sb.run(prog)
    assert r.status == "killed" and "process limit" in r.reason


def test_file_writes_outside_the_work_dir_are_refused(sandbox, tmp_path):
    target = Path("/tmp") / f"escape_{secrets.token_hex(6)}"
    sibling = Path(tempfile.gettempdir()) / "x"  # `../x` seen from a work dir
    before = sibling.stat().st_mtime_ns if sibling.exists() else None
    for prog in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nfd = os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        "open('../x', 'w').write('x')",
        "import os\nos.symlink('/tmp', 'link')\nopen('link/y', 'w').write('x')",
        "import os\nos.rename('/etc/hostname', 'h')",
    ):
        r = sandbox.run(prog)
        assert r.status == "error" and "not allowed" in r.reason, (prog, r)
        assert not target.exists()
    after = sibling.stat().st_mtime_ns if sibling.exists() else None
    assert after == before  # `../x` (next to the work dir) was not created or touched
    # inside its own directory the program may write and read back
    ok = sandbox.run("open('a.txt', 'w').write('hi')\nassert open('a.txt').read() == 'hi'")
    assert ok.status == "ok", ok


@pytest.mark.parametrize("hook", [True, False])
def test_environment_secrets_are_not_visible(hook, monkeypatch):
    sandbox = Sandbox(SandboxConfig(timeout_s=10.0, audit_hook=hook))
    if not hook and not {"readonly_fs", "uid"} & set(sandbox.layers):
        # same uid, host /proc: the kernel lets a process read its parent's environment
        pytest.skip(f"no fresh /proc or other uid here: {sandbox.layers}")
    secret = f"s3cret-{secrets.token_hex(8)}"
    monkeypatch.setenv("HYBRIDLM_TEST_API_KEY", secret)
    prog = (
        "import os\n"
        "print(sorted(os.environ.items()))\n"
        f"for pid in ('1', str(os.getppid()), {str(os.getpid())!r}):\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print('refused', e)\n"
    )
    r = sandbox.run(prog)
    assert r.status == "ok"
    assert secret not in r.stdout and "HYBRIDLM_TEST_API_KEY" not in r.stdout
    assert "PATH" in r.stdout  # the environment is there, rebuilt from scratch


@pytest.mark.parametrize("hook", [True, False])
def test_network_is_unreachable(hook):
    sb = Sandbox(SandboxConfig(timeout_s=5.0, audit_hook=hook))
    if not hook and "netns" not in sb.layers:
        pytest.skip(f"no network namespace here (unshare --net: {namespace_support(True, False)})")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    prog = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'leak')\n"
    )
    try:
        r = sb.run(prog)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()
    assert r.status == "error" and not r.passed
    assert ("socket" in r.reason and "not allowed" in r.reason) if hook else "OSError" in r.reason


def test_memory_hog_is_killed():
    sb = Sandbox(SandboxConfig(timeout_s=20.0, memory_mb=256))
    for prog in ("x = bytearray(8 << 30)", "xs = []\nwhile True:\n    xs.append(b'x' * (1 << 24))"):
        r = sb.run(prog, ["assert True"])
        assert r.status == "killed" and "memory" in r.reason and not r.passed, r


def test_huge_output_is_truncated():
    sb = Sandbox(SandboxConfig(timeout_s=10.0, max_output_bytes=1000))
    r = sb.run(
        "import sys\nfor _ in range(20000):\n    sys.stdout.write('y' * 1000)\n"
        "sys.stderr.write('e' * 100000)"
    )
    assert r.status == "ok"
    assert r.stdout.startswith("y" * 1000) and r.stdout.endswith("...[truncated]")
    assert len(r.stdout) <= 1000 + 20 and len(r.stderr) <= 1000 + 20


def test_run_many_keeps_order_and_isolates(sandbox):
    jobs = [
        (f"def f():\n    return {i}\n", [f"assert f() == {i if i % 3 else -1}"]) for i in range(8)
    ]
    results = sandbox.run_many(jobs)
    assert [r.passed for r in results] == [i % 3 != 0 for i in range(8)]
    # a crash in one job does not affect its neighbours
    short = Sandbox(SandboxConfig(timeout_s=1.0), max_workers=2)
    mixed = short.run_many([("while True: pass", []), ("x = 2", ["assert x == 2"])])
    assert mixed[0].status == "timeout" and mixed[1].passed


def test_config_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxConfig(max_processes=0)
    with pytest.raises(ValueError, match="interpreter"):
        SandboxConfig(python="/no/such/python")
    with pytest.raises(ValueError, match="max_workers"):
        Sandbox(max_workers=0)
    with pytest.raises(TypeError):
        Sandbox().run("x = 1", [42])


def test_humaneval_canonical_passes_broken_fails(sandbox):
    problems = builtin.read_jsonl(builtin.path(builtin.HUMANEVAL), limit=6)
    tests = [[p["test"] + f"\ncheck({p['entry_point']})\n"] for p in problems]
    good = sandbox.run_many(
        [(p["prompt"] + p["canonical_solution"], t) for p, t in zip(problems, tests, strict=True)]
    )
    assert [r.status for r in good] == ["ok"] * len(problems), [r.reason for r in good]
    # broken: the body returns None
    broken = sandbox.run_many(
        [(p["prompt"] + "    return None\n", t) for p, t in zip(problems, tests, strict=True)]
    )
    assert all(r.status in ("failed", "error") for r in broken), [r.status for r in broken]


def test_kernel_layers_without_the_audit_hook():
    """Read-only filesystem (mount namespace), no capabilities, a fresh /proc: checked with the
    audit hook off, so the kernel alone refuses."""
    sb = Sandbox(SandboxConfig(timeout_s=10.0, audit_hook=False))
    if not {"readonly_fs", "no_capabilities", "pidns"} <= set(sb.layers):
        pytest.skip(f"needs root with mount and PID namespaces; active layers: {sb.layers}")
    target = Path("/tmp") / f"escape_{secrets.token_hex(6)}"
    r = sb.run(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "error" and "Read-only file system" in r.reason and not target.exists()
    prog = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('mount', libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"
        "print('pids', sorted(int(d) for d in os.listdir('/proc') if d.isdigit()))\n"
        "print('capeff', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "open('mine.txt', 'w').write('ok')\n"
        "print('own dir', open('mine.txt').read())\n"
    )
    r = sb.run(prog)
    assert r.status == "ok", r
    assert "mount -1 1" in r.stdout  # EPERM: no CAP_SYS_ADMIN to remount read-write
    assert "pids [1, 2]" in r.stdout  # only this namespace's init and the program
    assert "capeff 0000000000000000" in r.stdout and "own dir ok" in r.stdout


@pytest.mark.slow
def test_unprivileged_uid_layer():
    """As root with an interpreter other users can read (here the system Python), the program
    runs as a fresh uid: RLIMIT_NPROC then bounds a fork bomb by itself."""
    if os.geteuid() != 0:
        pytest.skip("the uid layer is for root")
    python = next(
        (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None
    )
    if python is None:
        pytest.skip("no system python3")
    sb = Sandbox(SandboxConfig(timeout_s=10.0, python=python, audit_hook=False, max_processes=8))
    if "uid" not in sb.layers:
        pytest.skip(f"{python} is not readable by other users")
    assert "pids_cgroup" not in sb.layers and "no_capabilities" not in sb.layers
    r = sb.run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    uid = int(r.stdout.split()[0])
    assert r.status == "ok" and uid >= 200_000 and r.stdout.split()[1] == str(uid)
    bomb = sb.run("import os\nwhile True:\n    os.fork()\n")
    assert bomb.status == "killed" and "process limit" in bomb.reason


_AS_NOBODY = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
sb = sandbox.Sandbox(sandbox.SandboxConfig(timeout_s=10, audit_hook=False, max_processes=8))
print("uid", os.getuid(), "layers", ",".join(sb.layers))
for prog in ("import os\\nwhile True:\\n    os.fork()", "open(sys.argv[2], 'w')",
             "import socket\\nsocket.create_connection(('127.0.0.1', 22), timeout=1)"):
    r = sb.run(prog.replace("sys.argv[2]", repr(sys.argv[2])))
    print("result", r.status, r.reason)
"""


@pytest.mark.slow
def test_unprivileged_user_gets_the_kernel_layers(tmp_path):
    """An ordinary user (here: root dropping to `nobody` with setpriv, running the system
    Python on this stdlib-only module) gets net/PID/mount namespaces inside a user namespace,
    no capabilities, and RLIMIT_NPROC counted per user namespace; the audit hook is off."""
    import shutil
    import subprocess

    import hybridlm.rl.sandbox as mod

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to become an ordinary user")
    target = f"/tmp/escape_{secrets.token_hex(6)}"
    cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
    out = subprocess.run(
        [*cmd, "-c", _AS_NOBODY, mod.__file__, target],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/tmp",
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("uid 65534 layers ")
    layers = set(lines[0].split()[-1].split(","))
    if "userns" not in layers:
        pytest.skip(f"unprivileged user namespaces are not allowed here: {layers}")
    assert {"netns", "pidns", "readonly_fs", "no_capabilities"} <= layers
    bomb, write, net = lines[1:4]
    assert bomb.startswith("result killed") and "process limit" in bomb
    assert write.startswith("result error") and "Read-only file system" in write
    assert net.startswith("result error") and "unreachable" in net
    assert not os.path.exists(target)
