"""Run untrusted Python programs against tests, for code rewards and pass@k.

Verifiable code rewards run model-written programs (OlmoRL, Olmo 3 §4.4.1 / Figure 16: "run test
cases"; Nemotron 3 Super §3.2.1 code environments), and RL optimises whatever the verifier says,
so a program that can make the verifier say "pass" without solving the task will be found.

## Threat model

The program is adversarial Python. It may walk frames, patch builtins, return objects with a
custom `__eq__`, exit early with status 0, print forged results, read any file it can name,
try the network, fork without end, fill memory and disk, or spend CPU forever. It must not (1)
change a verdict other than by what its functions return or print, (2) read or change anything
of the host (files, environment, other processes), (3) take the machine down or leave anything
behind. It runs on the host's kernel: a kernel exploit is out of scope (run the whole reward
worker in a VM for that), as are timing side channels.

## Layers

1. **Verdicts outside the program.** Each run has three processes: this one, the *program
   process* and the *judge* (`_sandbox_child.py`). The program process executes the program and
   never sees a test. The judge, a separate interpreter outside the sandbox's namespaces, runs
   the test code (`assert f(1) == 2`, HumanEval's `check(candidate)`), where the program's
   top-level names are handles: calling one sends the arguments over a pipe, and the result comes
   back as plain data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set,
   frozenset), decoded into fresh objects of exactly those types; anything else stays a handle
   that has no truth value and equals only itself. Frame walking, patched builtins, a custom
   `__eq__`, `os._exit(0)` or a forged line on stdout reach nothing the judge uses; a program
   that dies mid-test fails it, even if the test catches exceptions. For stdio tests the judge
   sends one stdin at a time and compares the returned stdout with an expectation the program
   never receives. Only the judge writes the verdict, on a pipe the program does not hold, and
   only "every test passed" is a pass.
2. **A private root** (mount namespace + `pivot_root`): a tmpfs holding, read-only, the
   interpreter, its standard library and the shared libraries it loads (found by a probe that
   imports every `lib-dynload` module), with empty masks over site-packages; `/dev/null`,
   `zero`, `urandom`, `random`; a fresh `/proc` showing only the sandbox's processes; and a
   writable tmpfs at `/sandbox` (also `/tmp`) limited to `disk_mb` and 4096 inodes, which is the
   total disk the program can fill. The host's filesystem (`/etc/shadow`, its `/tmp`, the
   project, other users' homes) is not in the namespace at all.
3. **Identity**: as root, the program runs as a fresh unprivileged uid drawn at random (no
   capabilities, no files of its own outside `/sandbox`); for an ordinary user, whose sandbox
   is set up as root of a new user namespace, the program runs as uid 65534 of a nested one
   (its own uid outside). Both lose every capability and get `no_new_privs`.
4. **Namespaces**: a new network namespace (only a downed loopback: not even the host's
   127.0.0.1) and a PID namespace whose init reaps the program and, on exit, makes the kernel
   kill every process left in it.
5. **Resource limits**: `setrlimit` (CPU seconds, address space, file size, open files, no core
   files), a process bound (`RLIMIT_NPROC` for a fresh uid or inside a user namespace, a `pids`
   cgroup for root that keeps uid 0), the `/sandbox` quota, pipes drained into bounded buffers, and
   a wall-clock deadline that kills both process groups (and with them the PID namespace).
6. **Process hygiene**: `python -I -S` (no site-packages, no `PYTHON*` variables), an
   environment rebuilt from scratch (nothing inherited, so no secrets), stdin closed, a new
   session; the judge is not dumpable (no ptrace, no `/proc/<pid>/mem`).
7. **Audit hook** (PEP 578) refusing sockets, process creation, `ctypes` calls and writes
   outside `/sandbox`: defence in depth only, since code in the same interpreter can disable it.

Layers 2-4 need namespaces: real root (as in most containers and CI runners) or, for an
ordinary user, unprivileged user namespaces (`unshare --user` must work). Without them the
sandbox refuses to start (`SandboxUnavailable`, naming what is missing) unless the caller opts
into the weaker mode with `SandboxConfig(allow_weak_isolation=True)` or the environment
variable `HYBRIDLM_SANDBOX_ALLOW_WEAK=1`: then layers 1, 5 (without the quota), 6 and 7 still
hold, verdicts stay unforgeable, but the program sees the host's files with the caller's rights,
and a warning says so on every `Sandbox()`. `Sandbox.layers` names the active layers.

Each run costs two interpreter starts plus the root's mounts: `benchmarks/sandbox.py` measures
runs per second and every escape class in this docstring. Outputs are read through pipes and
truncated to `max_output_bytes`. `Sandbox.run_many` runs many programs on a bounded pool of
threads (each waits on its run's processes), the shape an RL reward worker or pass@k needs.
Standard library only: this module is also loaded by itself (`setpriv` tests, other
interpreters).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Status = Literal["ok", "failed", "timeout", "error", "killed"]
_STATUSES = ("ok", "failed", "timeout", "error", "killed")
_UID_RANGE = (200_000, 1_200_000)  # fresh uids for sandboxed programs (no passwd entry needed)
_MIN_PATH = "/usr/local/bin:/usr/bin:/bin"
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_WEAK_ENV = "HYBRIDLM_SANDBOX_ALLOW_WEAK"


# the program process's whole command line: the child module's source follows on stdin
_BOOT = (
    "import sys;n=int(sys.stdin.buffer.readline());"
    "exec(compile(sys.stdin.buffer.read(n),'<sandbox>','exec'))"
)


@lru_cache(maxsize=1)
def _child_source() -> bytes:
    with open(_CHILD, "rb") as f:
        return f.read()


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate untrusted code fully and weak isolation was not allowed."""


@dataclass(frozen=True, kw_only=True)
class StdioTest:
    """A competitive-programming style test: run the program with `stdin`; its stdout must equal
    `expected_stdout` up to whitespace between tokens. The program never sees the expectation."""

    stdin: str
    expected_stdout: str
    name: str = ""


@dataclass(frozen=True, kw_only=True)
class FunctionTest:
    """Test code the judge runs (never the program): `code` (`assert f(2) == 4`, or HumanEval's
    `def check(candidate): ...` then `check(f)`) sees the program's top-level names as handles.
    `setup` is trusted code run first in the same scope whose definitions take precedence over
    the program's: the helpers a prompt gives (HumanEval/32's `poly`, /38's `encode_cyclic`)
    must be the dataset's, or a program could redefine the function the test checks it with."""

    code: str
    setup: str = ""
    name: str = ""


Test = str | FunctionTest | StdioTest  # a str is FunctionTest(code=str)


def humaneval_test(rec: dict) -> FunctionTest:
    """A HumanEval record's test for the judge: `check(<entry_point>)`, with the prompt's
    preamble (imports and given helpers such as HumanEval/32's `poly`) as trusted setup, so the
    checks use the dataset's helpers, never ones the program redefines."""
    m = re.search(rf"^def\s+{re.escape(rec['entry_point'])}\s*\(", rec["prompt"], flags=re.M)
    return FunctionTest(
        code=f"{rec['test']}\ncheck({rec['entry_point']})\n",
        setup=rec["prompt"][: m.start()] if m else "",
        name=str(rec.get("task_id", "")),
    )


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits and isolation layers of one sandboxed run."""

    timeout_s: float = 10.0  # wall clock for the whole run (program + all tests)
    cpu_s: int | None = None  # RLIMIT_CPU seconds; default int(timeout_s) + 2
    memory_mb: int = 1024  # RLIMIT_AS (address space)
    file_size_mb: int = 16  # RLIMIT_FSIZE
    disk_mb: int = 64  # the writable /sandbox tmpfs: all files together
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_processes: int = 16  # processes + threads, the runner's own included
    max_output_bytes: int = 16_384  # per stream; the rest is dropped
    user_namespace: bool = True  # not root: the namespaces below inside `unshare --user`
    network_namespace: bool = True  # `unshare --net`
    pid_namespace: bool = True  # `unshare --pid --fork`
    readonly_filesystem: bool = True  # the private root (mount namespace + pivot_root)
    drop_privileges: bool = True  # a fresh uid as root, no capabilities otherwise
    audit_hook: bool = True
    allow_weak_isolation: bool = False  # run even where layers 2-4 are unavailable (see above)
    python: str = sys.executable

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "file_size_mb", "disk_mb", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ValueError(f"SandboxConfig.cpu_s must be >= 1 (or None), got {self.cpu_s}")
        if self.max_processes < 1:
            raise ValueError(f"SandboxConfig.max_processes must be >= 1, got {self.max_processes}")
        if self.max_output_bytes < 0:
            raise ValueError("SandboxConfig.max_output_bytes must be >= 0")
        if not os.path.exists(self.python):
            raise ValueError(f"SandboxConfig.python: no interpreter at {self.python!r}")


@dataclass(frozen=True, kw_only=True)
class TestOutcome:
    name: str
    passed: bool
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """What one run did. `status`: ok (every test passed, as the judge saw it), failed (some
    test failed), timeout (wall clock), error (the program raised, did not compile, or died
    before the tests finished), killed (a resource limit: memory, CPU, file size, processes, or
    a signal)."""

    status: Status
    tests: tuple[TestOutcome, ...] = ()
    num_tests: int = 0
    stdout: str = ""
    stderr: str = ""
    runtime_s: float = 0.0
    returncode: int | None = None
    reason: str = ""
    layers: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    @property
    def num_passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def pass_rate(self) -> float:
        """Fraction of the tests that passed (tests never reached count as failed)."""
        if self.num_tests == 0:
            return 1.0 if self.passed else 0.0
        return self.num_passed / self.num_tests


_UNSHARE_FLAGS = {
    "user": ["--user", "--map-root-user"],
    "net": ["--net"],
    "pid": ["--pid", "--fork", "--kill-child"],
    "mount": ["--mount", "--propagation", "private"],
}


@lru_cache(maxsize=16)
def namespace_support(kind: str, user: bool = False) -> bool:
    """Whether `unshare` can create a `user`, `net`, `pid` or `mount` namespace here, inside a
    new user namespace with `user` (how an unprivileged user gets the others); probed once."""
    if kind not in _UNSHARE_FLAGS:
        raise ValueError(f"kind must be one of {sorted(_UNSHARE_FLAGS)}, got {kind!r}")
    exe = shutil.which("unshare")
    if exe is None:
        return False
    flags = (_UNSHARE_FLAGS["user"] if user and kind != "user" else []) + _UNSHARE_FLAGS[kind]
    try:
        r = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


_PROBE = r"""
import importlib, json, os, site, sys, sysconfig
paths = sysconfig.get_paths()
dynload = [p for p in sys.path if p.endswith("lib-dynload") and os.path.isdir(p)]
for d in dynload:
    for f in sorted(os.listdir(d)):
        if f.endswith(".so") and not f.startswith(("_test", "_tkinter", "_curses", "readline")):
            try:
                importlib.import_module(f.split(".")[0])
            except BaseException:
                pass
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith("/") and os.path.isfile(parts[5]):
            maps.add(parts[5])
sites = set(site.getsitepackages()) | {paths["purelib"], paths["platlib"]}
sites |= {p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))}
exe = getattr(sys, "_base_executable", sys.executable)
stdlib = [os.path.dirname(os.__file__), *dynload]
print(json.dumps({"exe": os.path.realpath(exe), "stdlib": stdlib,
                  "libs": sorted(maps), "sites": sorted(sites)}))
"""


def _elf_interpreter(path: str) -> str | None:
    """The PT_INTERP path (the dynamic loader) of an ELF executable, or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return None
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide:
                (phoff,) = struct.unpack_from(order + "Q", head, 0x20)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 0x36)
            else:
                (phoff,) = struct.unpack_from(order + "I", head, 0x1C)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 0x2A)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                ph = f.read(phentsize)
                if struct.unpack_from(order + "I", ph, 0)[0] != 3:  # PT_INTERP
                    continue
                if wide:
                    off, size = struct.unpack_from(order + "Q", ph, 8)[0], struct.unpack_from(
                        order + "Q", ph, 0x20)[0]  # fmt: skip
                else:
                    off, size = struct.unpack_from(order + "I", ph, 4)[0], struct.unpack_from(
                        order + "I", ph, 16)[0]  # fmt: skip
                f.seek(off)
                return f.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _symlink_chain(path: str, links: dict[str, str], depth: int = 0) -> str:
    """Resolve `path` one component at a time, recording every symlink met (so that the same
    path resolves inside the private root); returns the resolved path."""
    parts = [p for p in path.split("/") if p]
    cur = ""
    for i, part in enumerate(parts):
        nxt = f"{cur}/{part}"
        if depth < 32 and os.path.islink(nxt):
            target = os.readlink(nxt)
            links[nxt] = target
            base = target if target.startswith("/") else os.path.join(cur or "/", target)
            rest = "/".join(parts[i + 1 :])
            return _symlink_chain(os.path.normpath(f"{base}/{rest}" if rest else base), links,
                                  depth + 1)  # fmt: skip
        cur = nxt
    return cur or "/"


@lru_cache(maxsize=4)
def root_plan(python: str) -> dict | None:
    """What the private root holds for `python`: its real executable, the directories to bind
    read-only (standard library, shared libraries it loads, the loader), the symlinks leading
    to them, and the site-packages to mask. None when the probe fails (probed once)."""
    try:
        out = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, timeout=60,
                             check=True, env={"PATH": _MIN_PATH}).stdout  # fmt: skip
        info = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    links: dict[str, str] = {}
    for entry in os.listdir("/"):
        if os.path.islink("/" + entry):
            links["/" + entry] = os.readlink("/" + entry)
    exe = info["exe"]
    files = {exe}
    if os.path.exists("/etc/ld.so.cache"):
        files.add("/etc/ld.so.cache")
    loader = _elf_interpreter(exe)
    dirs = {os.path.realpath(p) for p in info["stdlib"]}
    for path in [*info["libs"], *([loader] if loader else [])]:
        real = _symlink_chain(path, links)
        if real != exe:
            dirs.add(os.path.dirname(real))
    binds: list[str] = []
    for p in sorted(dirs | files):
        if not any(p.startswith(b.rstrip("/") + "/") or p == b for b in binds):
            binds.append(p)
    import glob

    sites = set(info["sites"])
    for b in binds:  # the base interpreter's and the system's package directories too
        for pattern in ("site-packages", "dist-packages", "python3*/site-packages",
                        "python3*/dist-packages"):  # fmt: skip
            sites.update(glob.glob(os.path.join(b, pattern)))
    masks = []
    for site_dir in sites:
        real = os.path.realpath(site_dir)
        if any(real.startswith(b + "/") for b in binds if b not in files):
            masks.append(real)
    readable = all(
        os.stat(p).st_mode & stat.S_IROTH
        for p in [exe, *info["libs"], os.path.join(info["stdlib"][0], "os.py")]
        if os.path.exists(p)
    )
    return {
        "exe": exe,
        "binds": binds,
        "symlinks": sorted(links.items()),
        "masks": sorted(set(masks)),
        "readable": readable,
    }


@lru_cache(maxsize=1)
def pids_cgroup_base() -> str | None:
    """A cgroup directory (v1 `pids` hierarchy or v2 with the pids controller) under which this
    process may create child cgroups with a `pids.max`; None when it may not (probed once)."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if "pids" in ctrls.split(","):
                    candidates.append(os.path.join("/sys/fs/cgroup/pids", path.lstrip("/")))
                elif ctrls == "":
                    candidates.append(os.path.join("/sys/fs/cgroup", path.lstrip("/")))
    except OSError:
        return None
    for base in candidates:
        probe = os.path.join(base, f"hybridlm-probe-{secrets.token_hex(4)}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        try:
            with open(os.path.join(probe, "pids.max"), "w") as f:
                f.write("8")
            return base
        except OSError:
            continue
        finally:
            try:
                os.rmdir(probe)
            except OSError:
                pass
    return None


def _remove_cgroup(path: str) -> None:
    """Kill whatever is still in a sandbox's cgroup, then remove it."""
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
            except OSError:
                pass
            time.sleep(0.01)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Sandbox:
    """Runs programs under a `SandboxConfig`; `run` for one, `run_many` for a bounded pool."""

    def __init__(self, config: SandboxConfig | None = None, *, max_workers: int = 4) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.config = config or SandboxConfig()
        self.max_workers = max_workers
        cfg = self.config
        root = os.geteuid() == 0
        # an unprivileged user gets the other namespaces inside a new user namespace, where it
        # is root (and then loses its capabilities)
        user = not root and cfg.user_namespace and namespace_support("user")
        self._plan = root_plan(cfg.python) if cfg.readonly_filesystem else None
        wanted = {
            "net": cfg.network_namespace,
            "pid": cfg.pid_namespace,
            "mount": self._plan is not None and (root or user),
        }
        self._ns = {k for k, want in wanted.items() if want and namespace_support(k, user)}
        if user and self._ns:
            self._ns.add("user")
        if "mount" not in self._ns:
            self._plan = None
        self._unshare: list[str] = []
        if self._ns:
            self._unshare = [shutil.which("unshare") or "unshare"]
            for k in ("user", "net", "pid", "mount"):
                if k in self._ns:
                    self._unshare += _UNSHARE_FLAGS[k]
        # a fresh uid only inside the private root (which makes the directories above the bound
        # files traversable) and only when those files are readable by other users
        readable = (self._plan or {}).get("readable", False)
        self._drop = cfg.drop_privileges and root and readable
        # every capability goes (bounding, effective, permitted, inheritable) with
        # no_new_privs: no mount, no kill of other users' processes, no ptrace, no setuid files
        self._drop_caps = cfg.drop_privileges and (root or "user" in self._ns)
        # RLIMIT_NPROC does not bind root: bound the process count with a pids cgroup instead
        self._cgroup = pids_cgroup_base() if root and not self._drop else None
        if self._drop:
            self._nproc_mode = "fresh_uid"  # the limit counts only the fresh uid's processes
        elif "user" in self._ns:
            self._nproc_mode = "userns"  # counted per user namespace (Linux >= 5.14)
        elif not root:
            self._nproc_mode = "shared_uid"  # counts every process of the caller's uid
        else:
            self._nproc_mode = "none"  # root ignores RLIMIT_NPROC
        missing = self.missing_layers()
        if missing:
            allowed = cfg.allow_weak_isolation or os.environ.get(_WEAK_ENV, "") not in ("", "0")
            message = (
                f"the sandbox cannot isolate untrusted code here: no {', '.join(missing)} "
                f"(needs root or unprivileged user namespaces: `unshare --user true` must work)"
            )
            if not allowed:
                raise SandboxUnavailable(
                    f"{message}; pass SandboxConfig(allow_weak_isolation=True) or set "
                    f"{_WEAK_ENV}=1 to run it with the host's files visible"
                )
            warnings.warn(f"WEAK SANDBOX: {message}; programs see the host's files", stacklevel=2)

    def missing_layers(self) -> list[str]:
        """The full-isolation layers (private root, PID and network namespaces, an unprivileged
        identity) that are not active here."""
        out = []
        if self._plan is None:
            out.append("private root (mount namespace)")
        if "pid" not in self._ns:
            out.append("PID namespace")
        if "net" not in self._ns:
            out.append("network namespace")
        if not (self._drop or "user" in self._ns):
            out.append("unprivileged uid")
        return out

    @property
    def layers(self) -> tuple[str, ...]:
        """The isolation layers active for this sandbox on this machine."""
        out = ["judge", "process", "rlimits"]
        if "user" in self._ns:
            out.append("userns")
        if "net" in self._ns:
            out.append("netns")
        if "pid" in self._ns:
            out.append("pidns")
        if self._plan is not None:
            out += ["private_root", "disk_quota"]
        if self._drop or ("user" in self._ns and self._plan is not None):
            out.append("uid")  # a fresh uid (root), or 65534 of a nested user namespace
        if self._drop_caps:
            out.append("no_capabilities")
        if self._cgroup:
            out.append("pids_cgroup")
        if self.config.audit_hook:
            out.append("audit_hook")
        return tuple(out)

    def run(
        self, program: str, tests: Sequence[Test] = (), *, files: dict[str, str] | None = None
    ) -> SandboxResult:
        """Run `program`, then each test; `files` (name -> text) are written to its work dir."""
        return self._run(program, list(tests), dict(files or {}))

    def run_many(
        self, jobs: Sequence[tuple[str, Sequence[Test]]], *, progress: bool = False
    ) -> list[SandboxResult]:
        """Run `(program, tests)` pairs on `max_workers` threads; results in input order."""
        jobs = [(p, list(t)) for p, t in jobs]
        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(jobs))) as pool:
            futures = [pool.submit(self._run, p, t, {}) for p, t in jobs]
            if progress:
                from rich.progress import track

                for future in track(futures, description="sandbox"):
                    future.result()
            return [f.result() for f in futures]

    # -- parent side ---------------------------------------------------------------------------

    @staticmethod
    def _test_spec(test: Test) -> dict:
        if isinstance(test, str):
            return {"kind": "code", "code": test, "setup": "", "name": ""}
        if isinstance(test, FunctionTest):
            return {"kind": "code", "code": test.code, "setup": test.setup, "name": test.name}
        if isinstance(test, StdioTest):
            return {"kind": "stdio", "stdin": test.stdin, "name": test.name,
                    "expected_stdout": test.expected_stdout}  # fmt: skip
        raise TypeError(
            f"a test must be a str, FunctionTest or StdioTest, got {type(test).__name__}"
        )

    def _run(self, program: str, tests: list[Test], files: dict) -> SandboxResult:
        if not isinstance(program, str):
            raise TypeError(f"program must be a str, got {type(program).__name__}")
        test_specs = [self._test_spec(t) for t in tests]
        for name, text in files.items():
            if not isinstance(name, str) or not isinstance(text, str):
                raise TypeError("files must map str names to str contents")
            if not name or "/" in name or name in (".", "..") or "\0" in name:
                raise ValueError(f"files: {name!r} must be a plain file name")
        cfg = self.config
        base = tempfile.mkdtemp(prefix="hybridlm-sandbox-")  # the root's mount point, or cwd
        judge_dir = tempfile.mkdtemp(prefix="hybridlm-judge-")
        uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if self._drop else -1
        t0 = time.monotonic()
        cgroup = None
        try:
            if self._cgroup:
                cgroup = os.path.join(self._cgroup, f"hybridlm-sandbox-{secrets.token_hex(6)}")
                os.mkdir(cgroup)
                with open(os.path.join(cgroup, "pids.max"), "w") as f:
                    f.write(str(cfg.max_processes))
            os.chmod(base, 0o700)  # a fresh uid implies the private root: base is a mount point
            root = None
            if self._plan is not None:
                root = {**self._plan, "base": base, "disk_mb": cfg.disk_mb, "inodes": 4096}
            program_spec = {
                "program": program,
                "files": files,
                "uid": uid,
                "cgroup": cgroup,
                "root": root,
                "drop_caps": self._drop_caps,
                "nested_user": "user" in self._ns and self._plan is not None,
                "nproc_mode": self._nproc_mode,
                "limits": {
                    "cpu": cfg.cpu_s or int(cfg.timeout_s) + 2,
                    "as": cfg.memory_mb << 20,
                    "fsize": cfg.file_size_mb << 20,
                    "nofile": cfg.max_open_files,
                    "nproc": cfg.max_processes,
                },
                "audit_hook": cfg.audit_hook,
                "max_output": cfg.max_output_bytes,
            }
            judge_spec = {"tests": test_specs, "cpu": cfg.cpu_s or int(cfg.timeout_s) + 2}
            return self._spawn(program_spec, judge_spec, base, judge_dir, t0, len(tests))
        finally:
            if cgroup:
                _remove_cgroup(cgroup)
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(judge_dir, ignore_errors=True)

    def _env(self, home: str) -> dict[str, str]:
        return {
            "PATH": _MIN_PATH,
            "HOME": home,
            "TMPDIR": home,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            # one thread per numeric library, so the process limit is not spent on BLAS pools
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _spawn(
        self, pspec: dict, jspec: dict, base: str, judge_dir: str, t0: float, num_tests: int
    ) -> SandboxResult:
        cfg = self.config
        req_r, req_w = os.pipe()  # judge -> program
        resp_r, resp_w = os.pipe()  # program -> judge
        ver_r, ver_w = os.pipe()  # judge -> here: the verdict
        pspec.update(req_fd=req_r, resp_fd=resp_w)
        jspec.update(req_fd=req_w, resp_fd=resp_r, verdict_fd=ver_w)
        python = self._plan["exe"] if self._plan is not None else cfg.python
        home = "/sandbox" if self._plan is not None else base
        procs: list[subprocess.Popen] = []
        try:
            for cmd, cwd, env, fds, spec in (
                (self._unshare + [python, "-I", "-S", "-B", "-c", _BOOT, "program"], base,
                 self._env(home), (req_r, resp_w), pspec),
                ([cfg.python, "-I", "-B", _CHILD, "judge"], judge_dir, self._env(judge_dir),
                 (req_w, resp_r, ver_w), jspec),
            ):  # fmt: skip
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    pass_fds=fds,
                    start_new_session=True,
                    close_fds=True,
                )
                procs.append(proc)
                try:
                    if spec is pspec:  # its code comes on stdin: no host path in its cmdline
                        proc.stdin.write(b"%d\n%s" % (len(_child_source()), _child_source()))
                    proc.stdin.write(json.dumps(spec).encode())
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
        except OSError as err:
            for proc in procs:
                _kill_group(proc)
                proc.wait()
            for fd in (req_r, req_w, resp_r, resp_w, ver_r, ver_w):
                os.close(fd)
            return SandboxResult(
                status="error", reason=f"could not start: {err}", layers=self.layers
            )
        finally:
            for fd in (req_r, req_w, resp_r, resp_w, ver_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        prog, judge = procs
        deadline = t0 + cfg.timeout_s
        cap = cfg.max_output_bytes
        streams = {
            prog.stdout.fileno(): bytearray(),
            prog.stderr.fileno(): bytearray(),
            judge.stderr.fileno(): bytearray(),
        }
        truncated = dict.fromkeys(streams, False)

        def keep(fd: int, chunk: bytes) -> None:  # bounded: the rest is drained and dropped
            room = cap - len(streams[fd])
            if room > 0:
                streams[fd] += chunk[:room]
            if len(chunk) > room:
                truncated[fd] = True

        verdict = bytearray()
        sel = selectors.DefaultSelector()
        for fd in (*streams, ver_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        timed_out = False
        try:
            while ver_r in sel.get_map():  # until the judge is done (its verdict pipe closes)
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                    fd = key.fd
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    if fd == ver_r:
                        if len(verdict) < 1 << 22:
                            verdict += chunk
                        continue
                    keep(fd, chunk)
            rc = None
            if not timed_out:
                try:  # the program process ends when the judge says exit (or it died already)
                    rc = prog.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            sel.close()
            # also ends the PID namespace: its init dies and the kernel kills the rest
            for proc in (judge, prog):
                _kill_group(proc)
                proc.wait()
            for fd in streams:  # what the processes wrote last, without waiting for more
                while True:
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except (BlockingIOError, OSError):
                        break
                    if not chunk:
                        break
                    keep(fd, chunk)
            for proc in (judge, prog):
                for f in (proc.stdout, proc.stderr):
                    f.close()
            os.close(ver_r)
        runtime = time.monotonic() - t0

        out_fd, err_fd, judge_err_fd = streams

        def text(fd: int) -> str:
            out = bytes(streams[fd]).decode("utf-8", errors="replace")
            return out + "\n...[truncated]" if truncated[fd] else out

        return self._result(
            bytes(verdict), rc, timed_out, runtime, text(out_fd), text(err_fd),
            text(judge_err_fd), num_tests,
        )  # fmt: skip

    def _result(
        self,
        raw: bytes,
        rc: int | None,
        timed_out: bool,
        runtime: float,
        stdout: str,
        stderr: str,
        judge_stderr: str,
        num_tests: int,
    ) -> SandboxResult:
        records = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                records.append(rec)
        tests = tuple(
            TestOutcome(name=str(r["name"]), passed=r["passed"] is True, error=str(r["error"]))
            for r in records
            if r.get("kind") == "test"
        )
        done = next((r for r in records if r.get("kind") == "done"), None)
        common = dict(
            tests=tests,
            num_tests=num_tests,
            stdout=stdout,
            stderr=stderr,
            runtime_s=runtime,
            returncode=rc,
            layers=self.layers,
        )
        if timed_out:
            return SandboxResult(
                status="timeout", reason=f"wall clock > {self.config.timeout_s}s", **common
            )
        if done is None or done.get("status") not in _STATUSES:
            last = judge_stderr.strip().splitlines()[-1:] or ["no verdict"]
            return SandboxResult(status="error", reason=f"judge failed: {last[0]}", **common)
        status, reason = done["status"], str(done.get("reason", ""))
        if status == "ok" and (len(tests) != num_tests or not all(t.passed for t in tests)):
            status, reason = "error", "judge reported ok without every test passing"
        if done.get("died"):  # the program process went away: say how
            sig = None
            if rc is not None and rc < 0:
                sig = -rc
            elif rc is not None and rc > 128 and "pid" in self._ns:
                sig = rc - 128  # the PID-namespace init reports its worker's signal as 128 + n
            if sig is not None:
                name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
                why = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit"}.get(str(name), "")
                return SandboxResult(
                    status="killed", reason=f"signal {name} {why}".strip(), **common
                )
            code = "still running" if rc is None else f"code {rc}"
            reason = f"the program process exited ({code}) before the tests finished"
        return SandboxResult(status=status, reason=reason, **common)
