"""Sandbox: correct/wrong programs, the judge's protocol, limits (time, memory, processes,
output, disk), every attack of `benchmarks/sandbox.py` (reward hacks, host reads, identity,
disk flood), forged results, weak-mode refusal, the worker pool, and all of HumanEval."""

import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import pytest

import hybridlm.rl.sandbox as sandbox_mod
from hybridlm.data import builtin
from hybridlm.rl.sandbox import (
    FunctionTest,
    Sandbox,
    SandboxConfig,
    SandboxUnavailable,
    StdioTest,
    humaneval_test,
    namespace_support,
)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import sandbox as attacks_bench  # noqa: E402 - benchmarks/sandbox.py: the attack catalogue

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
    fake = json.dumps({"kind": "done", "status": "ok", "reason": "forged"})
    for prog in (
        f"print({fake!r})\nimport os\nos._exit(0)",  # fake record, then skip the tests
        "import sys\nsys.exit(0)",  # leave before the tests run: they still run, and fail
        "import os\nos._exit(0)",
    ):
        r = sandbox.run(prog, ["assert False"])
        assert r.status in ("error", "failed") and not r.passed, (prog, r)


def test_the_judge_gets_plain_data(sandbox):
    """Results cross as plain data: types kept (tuple vs list, bytes, sets, big ints, floats),
    in-place changes to arguments copied back, generators and objects usable through handles,
    exceptions recreated as the judge's own builtin types, modules the program imported
    available to tests by the same name, trusted setup winning over the program's names."""
    prog = (
        "import math\n"
        "def kinds():\n"
        "    return (1, [2.5, float('inf')], {'a': b'x', (1, 2): {3, 4}}, 2 ** 100, -0.0, None,\n"
        "            frozenset({'z'}), complex(1, -2), bytearray(b'q'), range(2, 9, 3))\n"
        "def push(xs, d):\n    xs.append(len(xs))\n    d['n'] = d.get('n', 0) + 1\n"
        "def gen(n):\n    yield from range(n)\n"
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n"
        "    def __len__(self):\n        return len(self.items)\n"
        "def bad(x):\n    raise ValueError(f'bad {x}')\n"
        "def helper():\n    return 'program'\n"
        "LIMIT = 10 ** 9 + 7\n"
    )
    tests = [
        "assert kinds() == (1, [2.5, float('inf')], {'a': b'x', (1, 2): {3, 4}}, 2 ** 100, 0.0,"
        " None, frozenset({'z'}), 1 - 2j, bytearray(b'q'), range(2, 9, 3))",
        "assert type(kinds()[0]) is int and type(kinds()) is tuple and type(kinds()[1]) is list",
        "xs, d = [7], {}\npush(xs, d)\npush(xs, d)\nassert xs == [7, 1, 2] and d == {'n': 2}",
        "assert list(gen(4)) == [0, 1, 2, 3] and sum(gen(5)) == 10",
        "s = Stack().push(1).push(2)\nassert len(s) == 2 and s.items == [1, 2]",
        "try:\n    bad(3)\nexcept ValueError as e:\n    assert 'bad 3' in str(e)\n"
        "else:\n    raise AssertionError('no exception')",
        "assert math.isclose(math.pi, 3.14159, rel_tol=1e-5) and LIMIT == 1000000007",
        FunctionTest(
            setup="def helper():\n    return 'dataset'\n", code="assert helper() == 'dataset'"
        ),  # fmt: skip
    ]
    r = sandbox.run(prog, tests)
    assert r.status == "ok", [(t.name, t.error) for t in r.tests]
    # a handle has no truth value and equals only itself
    r = sandbox.run("class Eq:\n    def __eq__(self, o):\n        return True\n"
                    "def f():\n    return Eq()\n",
                    ["assert f() == 1", "assert f()", "assert f() != f()"])  # fmt: skip
    assert [t.passed for t in r.tests] == [False, False, True], r.tests
    assert "no truth value" in r.tests[1].error


def test_a_program_dying_inside_a_caught_call_still_fails(sandbox):
    """Test code that catches Exception around a call cannot swallow the program's death."""
    test = "try:\n    f(1)\nexcept Exception:\n    pass\nassert True"
    r = sandbox.run("import os\ndef f(x):\n    os._exit(0)\n", [test, "assert True"])
    assert r.status == "error" and not r.passed and r.num_passed == 0, r


def test_infinite_loop_times_out_within_limit():
    sb = Sandbox(SandboxConfig(timeout_s=1.0))
    t0 = time.monotonic()
    r = sb.run("while True:\n    pass\n", ["assert True"])
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and not r.passed
    assert 1.0 <= r.runtime_s < 2.5 and elapsed < 3.5


def _sandbox_processes() -> list[int]:
    """Host pids of sandboxed program processes (live or zombie)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if d.isdigit() and b"exec(compile(sys.stdin" in f.read():
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


def test_host_files_are_never_touched(sandbox):
    """Writes go to the sandbox's own tmpfs (`/tmp` there is its `/sandbox`) or fail on the
    read-only root; nothing of the host's changes, and a file the program wrote is gone after."""
    target = Path("/tmp") / f"escape_{secrets.token_hex(6)}"
    for prog in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nfd = os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')",
        "open('../x', 'w').write('x')",
        "import os\nos.symlink('/tmp', 'link')\nopen('link/y', 'w').write('x')",
        "import os\nos.rename('/etc/hostname', 'h')",
    ):
        sandbox.run(prog)
        assert not target.exists(), prog
    assert not Path("/x").exists() and not Path("/tmp/y").exists()
    ok = sandbox.run("open('a.txt', 'w').write('hi')\nassert open('a.txt').read() == 'hi'")
    assert ok.status == "ok", ok


def test_disk_quota_bounds_all_files_together():
    sb = Sandbox(SandboxConfig(timeout_s=10.0, disk_mb=8, file_size_mb=4, audit_hook=False))
    prog = (
        "import os\ntotal = 0\n"
        "try:\n"
        "    for i in range(100):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(4):\n"
        "                f.write(b'x' * (1 << 20))\n                total += 1\n"
        "except OSError as err:\n    print('stopped', err.errno)\n"
        "s = os.statvfs('.')\nprint('used', (s.f_blocks - s.f_bfree) * s.f_frsize >> 20)\n"
    )
    r = sb.run(prog)
    assert r.status == "ok" and "stopped 28" in r.stdout, r  # ENOSPC
    assert int(r.stdout.split("used")[1].split()[0]) <= 8


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


def test_humaneval_all_canonical_pass_and_forged_ones_fail(sandbox):
    """All 164 canonical solutions pass through the judge; an always-equal object returned by
    every entry point passes none (the judge compares plain data only)."""
    problems = builtin.read_jsonl(builtin.path(builtin.HUMANEVAL))
    tests = [[humaneval_test(p)] for p in problems]
    good = sandbox.run_many(
        [(p["prompt"] + p["canonical_solution"], t) for p, t in zip(problems, tests, strict=True)]
    )
    failing = [
        (p["task_id"], r.reason) for p, r in zip(problems, good, strict=True) if not r.passed
    ]
    assert len(problems) == 164 and failing == []
    forged = "    class _E:\n        __eq__ = lambda s, o: True\n    return _E()\n"
    bad = sandbox.run_many(
        [(p["prompt"] + forged, t) for p, t in zip(problems, tests, strict=True)]
    )
    assert [p["task_id"] for p, r in zip(problems, bad, strict=True) if r.passed] == []


@pytest.fixture(scope="module")
def planted():
    ctx = attacks_bench.plant_secrets()
    yield ctx
    os.unlink(ctx["canary"])
    os.environ.pop("HYBRIDLM_BENCH_SECRET", None)


@pytest.mark.parametrize(
    "attack", attacks_bench.attacks({"canary": "/tmp/x"}), ids=lambda a: a.name
)
def test_attack_does_not_escape(attack, planted):
    """One test per attack class of `benchmarks/sandbox.py`: frame walking, calling the
    reporter, early exits, patched builtins, always-equal objects, shadowed judge builtins,
    redefined trusted helpers, forged stdio, /etc/shadow, a 0600 canary in the host's /tmp,
    project files, the parent's environment, other processes, the audit hook disabled then a
    subprocess, a disk flood, the network, killing everything."""
    attack = next(a for a in attacks_bench.attacks(planted) if a.name == attack.name)
    disk_mb = 16
    sb = Sandbox(SandboxConfig(timeout_s=15.0, disk_mb=disk_mb))
    r = sb.run(attack.program, attacks_bench.to_tests(sandbox_mod, attack.tests))
    why = attacks_bench.judge_attack(attack, r, planted, disk_mb)
    assert why == [], (why, r)
    if attack.tests:
        assert not r.passed


def test_attack_controls_pass(sandbox):
    """The attacks' tests are passable: a correct program passes each kind."""
    report = attacks_bench.run_attacks(sandbox_mod, sandbox, 64)
    assert report["controls_passed"] == report["controls"], report["control_failures"]
    assert report["escapes"] == 0 and report["false_passes"] == 0


def test_weak_isolation_is_refused_unless_asked(monkeypatch):
    """Without namespaces the sandbox refuses to start; opted in, it warns, and verdicts stay
    unforgeable (the judge does not need namespaces)."""
    monkeypatch.setattr(sandbox_mod, "namespace_support", lambda kind, user=False: False)
    monkeypatch.delenv("HYBRIDLM_SANDBOX_ALLOW_WEAK", raising=False)
    with pytest.raises(SandboxUnavailable, match="allow_weak_isolation"):
        Sandbox(SandboxConfig(drop_privileges=False))
    with pytest.warns(UserWarning, match="WEAK SANDBOX"):
        weak = Sandbox(SandboxConfig(timeout_s=10.0, allow_weak_isolation=True,
                                     drop_privileges=False))  # fmt: skip
    assert "private_root" not in weak.layers and "judge" in weak.layers
    assert weak.run("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3"]).passed
    forged = weak.run("class E:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n"
                      "    return E()\n", ["assert add(1, 2) == 3"])  # fmt: skip
    assert not forged.passed
    monkeypatch.setenv("HYBRIDLM_SANDBOX_ALLOW_WEAK", "1")
    with pytest.warns(UserWarning, match="WEAK SANDBOX"):
        Sandbox(SandboxConfig(drop_privileges=False))


def test_kernel_layers_without_the_audit_hook():
    """Private read-only root, no capabilities, a fresh /proc, an unprivileged uid: checked with
    the audit hook off, so the kernel alone refuses."""
    sb = Sandbox(SandboxConfig(timeout_s=10.0, audit_hook=False))
    target = Path("/tmp") / f"escape_{secrets.token_hex(6)}"
    prog = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('mount', libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"
        "print('pids', sorted(int(d) for d in os.listdir('/proc') if d.isdigit()))\n"
        "print('capeff', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "print('uid', os.getuid())\n"
        "try:\n    open('/usr/x', 'w')\nexcept OSError as e:\n    print('root', e.strerror)\n"
        f"open({str(target)!r}, 'w').write('x')\n"
        "open('mine.txt', 'w').write('ok')\n"
        "print('own dir', open('mine.txt').read())\n"
    )
    r = sb.run(prog)
    assert r.status == "ok", r
    assert "mount -1 1" in r.stdout  # EPERM: no CAP_SYS_ADMIN to remount read-write
    assert "pids [1, 2]" in r.stdout  # only this namespace's init and the program
    assert "capeff 0000000000000000" in r.stdout and "own dir ok" in r.stdout
    assert "uid 0" not in r.stdout and "root Read-only file system" in r.stdout
    assert not target.exists()  # its /tmp is its own


@pytest.mark.slow
def test_unprivileged_uid_layer():
    """As root with the system Python, the program runs as a fresh uid: RLIMIT_NPROC then bounds
    a fork bomb by itself."""
    if os.geteuid() != 0:
        pytest.skip("the fresh-uid layer is for root")
    python = next(
        (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None
    )
    if python is None:
        pytest.skip("no system python3")
    sb = Sandbox(SandboxConfig(timeout_s=10.0, python=python, audit_hook=False, max_processes=8))
    assert "uid" in sb.layers and "pids_cgroup" not in sb.layers
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


def _as_nobody(args: list[str]):
    import shutil
    import subprocess

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to become an ordinary user")
    cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=300, cwd="/tmp",
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@pytest.mark.slow
def test_unprivileged_user_gets_the_kernel_layers():
    """An ordinary user (root dropping to `nobody` with setpriv, running the system Python on
    this stdlib-only module) gets the private root, net/PID namespaces inside a user namespace,
    uid 65534 there, no capabilities, and RLIMIT_NPROC counted per user namespace."""
    target = f"/tmp/escape_{secrets.token_hex(6)}"
    out = _as_nobody(["-c", _AS_NOBODY, sandbox_mod.__file__, target])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("uid 65534 layers ")
    layers = set(lines[0].split()[-1].split(","))
    assert {"userns", "netns", "pidns", "private_root", "uid", "no_capabilities"} <= layers
    bomb, write, net = lines[1:4]
    assert bomb.startswith("result killed") and "process limit" in bomb
    assert write.startswith("result ok")  # into its own /tmp
    assert net.startswith("result error") and "unreachable" in net
    assert not os.path.exists(target)


@pytest.mark.slow
def test_attacks_as_an_ordinary_user():
    """`benchmarks/sandbox.py --quick` as `nobody`: controls pass, 0 escapes, 0 false passes."""
    out = _as_nobody([str(BENCH / "sandbox.py"), "--quick"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "escapes 0  false passes 0  host reads 0" in out.stdout
    assert "controls 3/3 pass" in out.stdout
