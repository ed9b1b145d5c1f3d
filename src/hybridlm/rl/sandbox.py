"""Run untrusted Python programs against tests in a subprocess, for code rewards and pass@k.

Verifiable code rewards run model-written programs (OlmoRL, Olmo 3 §4.4.1 / Figure 16: "run test
cases"; Nemotron 3 Super §3.2.1 code environments). Each call gets a fresh process and a fresh
directory, and the layers below, from strongest to weakest:

1. **Process**: `python -I` (isolated: no `PYTHONPATH`, no user site, `PYTHON*` variables
   ignored), `PYTHONNOUSERSITE=1`, an environment rebuilt from scratch (minimal `PATH`, `HOME`
   and `TMPDIR` set to the work directory; nothing inherited, so no secrets), stdin closed, a new
   session, cwd a fresh temporary directory deleted afterwards.
2. **Namespaces** (when `unshare` works here: as root, or for an ordinary user inside a new
   *user* namespace where it maps to root, as unprivileged containers do): a new *network*
   namespace (only a downed loopback: no route anywhere, not even to the host's 127.0.0.1); a
   new *PID* namespace whose init reaps the program and, when it exits, makes the kernel kill
   every process left in it, so nothing forked survives the call; and a private
   *mount* namespace with a fresh `/proc` (only the sandbox's processes, so no other process's
   environment) and every mount read-only except the work directory.
3. **Identity**: as root, the program runs as a fresh unprivileged uid drawn at random when the
   interpreter is readable by other users; otherwise (and as root of a user namespace) it keeps
   uid 0 but loses every capability (bounding, effective, permitted, inheritable) and gets
   `no_new_privs`, so it cannot remount the filesystem, `ptrace`, or signal other users'
   processes.
4. **Resource limits**: `setrlimit` in the child (CPU seconds, address space, file size, open
   files, no core files) and a process bound: `RLIMIT_NPROC` for a fresh uid or inside a user
   namespace (counted per namespace), a `pids` cgroup for root (which `RLIMIT_NPROC` does not
   bind) when cgroups are writable; an ordinary user without user namespaces gets
   `RLIMIT_NPROC` = its current process count + the limit. A wall-clock deadline kills the
   whole process group (and with it the PID namespace).
5. **Audit hook** (PEP 578) installed before user code runs: refuses socket creation / connect /
   bind, process spawning (`os.system`, `subprocess`, `exec*`, `spawn*`, `posix_spawn`, `fork`),
   foreign calls through `ctypes`, writing, creating, renaming or deleting files outside the work
   directory, opening directories outside it and reading `/proc/*/environ`. **This is defence in
   depth, not a security boundary**: code running inside the interpreter can get around an audit
   hook (CPython documents this); layers 1-4 are the ones the kernel enforces.

`Sandbox.layers` names the layers active on this machine (e.g. `('process', 'rlimits', 'netns',
'pidns', 'readonly_fs', 'no_capabilities', 'pids_cgroup', 'audit_hook')` as root in a container
whose Python lives under a 0700 `/root`; `('process', 'rlimits', 'userns', 'netns', 'pidns',
'readonly_fs', 'no_capabilities', 'audit_hook')` for an ordinary user). None of this is a VM or
a seccomp filter: the kernel is shared, as with the Apptainer sandboxes of Nemotron 3 Super's
SWE-RL (§3.2.5).

Outputs are read through pipes and truncated to `max_output_bytes` (the rest is drained and
dropped, so a program printing forever costs no memory). Test results come back on a separate
pipe, each record tagged with a per-run random token, so a program that prints a fake result,
calls `sys.exit(0)` or `os._exit(0)` does not pass: a run passes only when the runner itself
reports every test passed.

`Sandbox.run_many` runs many programs with a bounded pool of worker threads (each thread waits on
one child process), the shape an RL reward worker or a pass@k evaluation needs.

This file is also the child's runner (`python -I sandbox.py`), so it imports only the standard
library.
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Literal

Status = Literal["ok", "failed", "timeout", "error", "killed"]
_STATUSES = ("ok", "failed", "timeout", "error", "killed")
_UID_RANGE = (200_000, 1_200_000)  # fresh uids for sandboxed programs (no passwd entry needed)
_MIN_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True, kw_only=True)
class StdioTest:
    """A competitive-programming style test: run the program with `stdin`; its stdout must equal
    `expected_stdout` up to whitespace between tokens."""

    stdin: str
    expected_stdout: str
    name: str = ""


Test = str | StdioTest  # a str is code run after the program in its globals (e.g. `assert ...`)


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits and isolation layers of one sandboxed run."""

    timeout_s: float = 10.0  # wall clock for the whole run (program + all tests)
    cpu_s: int | None = None  # RLIMIT_CPU seconds; default int(timeout_s) + 2
    memory_mb: int = 1024  # RLIMIT_AS (address space)
    file_size_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_processes: int = 16  # processes + threads, the runner's two included
    max_output_bytes: int = 16_384  # per stream; the rest is dropped
    user_namespace: bool = True  # not root: the namespaces below inside `unshare --user`
    network_namespace: bool = True  # `unshare --net` when permitted
    pid_namespace: bool = True  # `unshare --pid --fork` when permitted
    readonly_filesystem: bool = True  # when root: mount namespace, all read-only but the work dir
    drop_privileges: bool = True  # when root: a fresh unprivileged uid, else no capabilities
    audit_hook: bool = True
    python: str = sys.executable

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "file_size_mb", "max_open_files"):
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
    """What one run did. `status`: ok (program ran and every test passed), failed (some test
    failed), timeout (wall clock), error (the program raised, did not compile, or exited before
    the runner reported), killed (a resource limit: memory, CPU, file size, processes, or a
    signal)."""

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


@lru_cache(maxsize=4)
def interpreter_readable_by_others(python: str) -> bool:
    """Whether an unprivileged uid can run `python` and import its standard library and
    site-packages (false e.g. for an interpreter under a 0700 `/root`)."""
    try:
        out = subprocess.run(
            [
                python,
                "-I",
                "-c",
                "import json, sys, sysconfig; "
                "print(json.dumps([sys.executable, *sysconfig.get_paths().values()]))",
            ],
            capture_output=True,
            timeout=30,
            check=True,
        ).stdout
        paths = [os.path.realpath(p) for p in json.loads(out)]
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    for path in paths:
        if not os.path.exists(path):
            continue
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(path)
        while parent and parent != "/":
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(parent)
    return True


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
        # is root (and then loses its capabilities like real root does below)
        user = not root and cfg.user_namespace and namespace_support("user")
        wanted = {
            "net": cfg.network_namespace,
            "pid": cfg.pid_namespace,
            # a read-only filesystem needs root (real, or in the user namespace) to mount it,
            # and a program without capabilities inside so that it cannot mount it back
            "mount": cfg.readonly_filesystem and (root or user),
        }
        self._ns = {k for k, want in wanted.items() if want and namespace_support(k, user)}
        if user and self._ns:
            self._ns.add("user")
        self._unshare: list[str] = []
        if self._ns:
            self._unshare = [shutil.which("unshare") or "unshare"]
            for k in ("user", "net", "pid", "mount"):
                if k in self._ns:
                    self._unshare += _UNSHARE_FLAGS[k]
        self._drop = cfg.drop_privileges and root and interpreter_readable_by_others(cfg.python)
        # uid 0 that stays uid 0 (real root, or root of the user namespace) loses every
        # capability instead: no mount, no kill of other users' processes, no ptrace
        self._drop_caps = cfg.drop_privileges and (root and not self._drop or "user" in self._ns)
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

    @property
    def layers(self) -> tuple[str, ...]:
        """The isolation layers active for this sandbox on this machine."""
        out = ["process", "rlimits"]
        if "user" in self._ns:
            out.append("userns")
        if "net" in self._ns:
            out.append("netns")
        if "pid" in self._ns:
            out.append("pidns")
        if "mount" in self._ns:
            out.append("readonly_fs")
        if self._drop:
            out.append("uid")
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
        """Run `program`, then each test; `files` (name -> text) are written to the work dir."""
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

    def _run(self, program: str, tests: list[Test], files: dict) -> SandboxResult:
        if not isinstance(program, str):
            raise TypeError(f"program must be a str, got {type(program).__name__}")
        for t in tests:
            if not isinstance(t, (str, StdioTest)):
                raise TypeError(f"a test must be a str or StdioTest, got {type(t).__name__}")
        cfg = self.config
        workdir = tempfile.mkdtemp(prefix="hybridlm-sandbox-")
        uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if self._drop else -1
        token = secrets.token_hex(16)
        t0 = time.monotonic()
        cgroup = None
        try:
            if self._cgroup:
                cgroup = os.path.join(self._cgroup, f"hybridlm-sandbox-{token[:12]}")
                os.mkdir(cgroup)
                with open(os.path.join(cgroup, "pids.max"), "w") as f:
                    f.write(str(cfg.max_processes))
            for name, text in files.items():
                path = os.path.realpath(os.path.join(workdir, name))
                if os.path.dirname(path) != os.path.realpath(workdir):
                    raise ValueError(f"files: {name!r} must be a plain file name")
                with open(path, "w") as f:
                    f.write(text)
            if uid >= 0:
                for p in [workdir] + [os.path.join(workdir, n) for n in files]:
                    os.chown(p, uid, uid)
            os.chmod(workdir, 0o700)
            spec = {
                "token": token,
                "program": program,
                "tests": [
                    t if isinstance(t, str) else {**asdict(t), "kind": "stdio"} for t in tests
                ],
                "uid": uid,
                "cgroup": cgroup,
                "readonly_fs": "mount" in self._ns,
                "drop_caps": self._drop_caps,
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
            return self._spawn(spec, workdir, t0, len(tests))
        finally:
            if cgroup:
                _remove_cgroup(cgroup)
            shutil.rmtree(workdir, ignore_errors=True)

    def _spawn(self, spec: dict, workdir: str, t0: float, num_tests: int) -> SandboxResult:
        cfg = self.config
        res_r, res_w = os.pipe()
        spec["result_fd"] = res_w
        env = {
            "PATH": _MIN_PATH,
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            # one thread per numeric library, so RLIMIT_NPROC is not spent on BLAS pools
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        cmd = self._unshare + [cfg.python, "-I", "-B", os.path.abspath(__file__)]
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                pass_fds=(res_w,),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as err:
            os.close(res_r)
            os.close(res_w)
            return SandboxResult(
                status="error", reason=f"could not start: {err}", layers=self.layers
            )
        os.close(res_w)
        try:
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        deadline = t0 + cfg.timeout_s
        cap = cfg.max_output_bytes
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray()}
        results = bytearray()
        truncated = {out_fd: False, err_fd: False}
        sel = selectors.DefaultSelector()
        for fd in (out_fd, err_fd, res_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        timed_out = False
        exited_at = None
        try:
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    timed_out = proc.poll() is None
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now  # the runner is gone: drain what is left, briefly
                if exited_at is not None and now - exited_at > 1.0:
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
                    if fd == res_r:
                        if len(results) < 1 << 22:
                            results += chunk
                    else:
                        room = cap - len(bufs[fd])
                        if room > 0:
                            bufs[fd] += chunk[:room]
                        if len(chunk) > room:
                            truncated[fd] = True
        finally:
            sel.close()
            # also ends the PID namespace: its init dies and the kernel kills the rest
            _kill_group(proc)
            proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()
            os.close(res_r)
        runtime = time.monotonic() - t0
        stdout = self._text(bufs[out_fd], truncated[out_fd])
        stderr = self._text(bufs[err_fd], truncated[err_fd])
        return self._result(
            spec["token"],
            bytes(results),
            proc.returncode,
            timed_out,
            runtime,
            stdout,
            stderr,
            num_tests,
        )

    @staticmethod
    def _text(buf: bytes, truncated: bool) -> str:
        text = bytes(buf).decode("utf-8", errors="replace")
        return text + "\n...[truncated]" if truncated else text

    def _result(
        self,
        token: str,
        raw: bytes,
        rc: int | None,
        timed_out: bool,
        runtime: float,
        stdout: str,
        stderr: str,
        num_tests: int,
    ) -> SandboxResult:
        records = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("token") == token:
                records.append(rec)
        tests = tuple(
            TestOutcome(name=r["name"], passed=bool(r["passed"]), error=r.get("error", ""))
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
        if done is not None and done.get("status") in _STATUSES:
            return SandboxResult(status=done["status"], reason=done.get("reason", ""), **common)
        sig = None
        if rc is not None and rc < 0:
            sig = -rc
        elif rc is not None and rc > 128 and "pid" in self._ns:
            sig = rc - 128  # the PID-namespace init reports its worker's signal as 128 + n
        if sig is not None:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
            why = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit"}.get(str(name), "")
            return SandboxResult(status="killed", reason=f"signal {name} {why}".strip(), **common)
        return SandboxResult(
            status="error", reason=f"exited (code {rc}) before the runner reported", **common
        )


# -- child side: runs in the sandboxed interpreter (`python -I sandbox.py`) ----------------------

_BLOCKED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "subprocess.Popen",
        "pty.spawn",
        "os.symlink",
        "os.link",
        "os.chroot",
        "resource.setrlimit",
        "resource.prlimit",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.call_function",
        "ctypes.cdata",
        "webbrowser.open",
    }
)
_PATH_EVENTS = {  # event -> indices of path arguments that must stay inside the work dir
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.replace": (0, 1),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
    "shutil.move": (0, 1),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
_PROC_SECRET = re.compile(r"^/proc/[^/]+/(task/\d+/)?(environ|mem|root|cwd|fd|map_files)(/|$)")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _install_audit_hook(root: str) -> None:
    """PEP 578 hook: see layer 5 in the module docstring."""
    import threading

    local = threading.local()
    devnull = os.devnull

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor
        p = os.path.realpath(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep) or p == devnull

    def hook(event: str, args: tuple) -> None:
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            if event in _BLOCKED_EVENTS or event.startswith("socket."):
                raise PermissionError(f"sandbox: {event} is not allowed")
            if event == "open":
                path, mode, flags = args
                writing = bool(flags & _WRITE_FLAGS) or (
                    isinstance(mode, str) and any(c in mode for c in "wax+")
                )
                if isinstance(path, (str, bytes)) and _PROC_SECRET.match(
                    os.path.realpath(os.fsdecode(path))
                ):
                    raise PermissionError(f"sandbox: reading {path!r} is not allowed")
                if path is not None and not inside(path):
                    if writing:
                        raise PermissionError(f"sandbox: writing {path!r} is not allowed")
                    if not isinstance(path, int) and os.path.isdir(os.fsdecode(path)):
                        raise PermissionError(f"sandbox: opening directory {path!r} is refused")
            elif event in _PATH_EVENTS:
                for i in _PATH_EVENTS[event]:
                    if i < len(args) and args[i] is not None and not inside(args[i]):
                        raise PermissionError(f"sandbox: {event} on {args[i]!r} is not allowed")
        finally:
            local.busy = False

    sys.addaudithook(hook)


_MS = {"rdonly": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "remount": 32, "bind": 4096}
_MS_KEEP = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
            "relatime": 1 << 21}  # fmt: skip


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(libc: Any, src: str | None, target: str, fstype: str | None, flags: int) -> None:
    import ctypes

    def enc(x: str | None) -> bytes | None:
        return x.encode() if x is not None else None

    if libc.mount(enc(src), enc(target), enc(fstype), flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _readonly_filesystem(workdir: str, fresh_proc: bool) -> None:
    """In a private mount namespace: a fresh /proc (only this PID namespace's processes), the
    work dir bind-mounted onto itself, then every other mount remounted read-only (keeping its
    nosuid/nodev/noexec flags). Device nodes such as /dev/null stay writable."""
    libc = _libc()
    if fresh_proc:
        _mount(libc, "proc", "/proc", "proc", _MS["nosuid"] | _MS["nodev"] | _MS["noexec"])
    _mount(libc, workdir, workdir, None, _MS["bind"])
    os.chdir(workdir)  # the old cwd still points below the bind mount, into what turns read-only
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if target == workdir:
            continue
        keep = sum(v for k, v in _MS_KEEP.items() if k in fields[5].split(","))
        try:
            _mount(libc, None, target, None, _MS["remount"] | _MS["bind"] | _MS["rdonly"] | keep)
        except OSError:
            if os.path.exists(target):  # a mount hidden by another one cannot be remounted
                raise


def _drop_capabilities() -> None:
    """Empty the bounding, effective, permitted and inheritable capability sets and set
    no_new_privs: uid 0 without capabilities cannot mount, kill other users' processes, ptrace,
    or override file permissions."""
    import ctypes

    libc = _libc()
    pr_capbset_drop, pr_set_no_new_privs = 24, 38
    cap = 0
    while libc.prctl(pr_capbset_drop, cap, 0, 0, 0) == 0:
        cap += 1
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    if libc.capset(header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _norm_tokens(text: str) -> list[str]:
    return text.split()


def _child_main() -> None:  # pragma: no cover - runs in the child process
    spec = json.loads(sys.stdin.buffer.read())
    token = spec.pop("token")
    result_fd = spec["result_fd"]
    if spec["cgroup"]:  # join the pids cgroup before anything can fork
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if spec["readonly_fs"]:
        _readonly_filesystem(os.path.realpath(os.getcwd()), fresh_proc=os.getpid() == 1)
    if os.getpid() == 1:
        # PID-namespace init: the kernel ignores most signals sent to init, so the program runs
        # in a child; init reaps everything and reports the worker's fate as an exit code.
        worker = os.fork()
        if worker:
            code = 0
            while True:
                try:
                    pid, status = os.wait()
                except ChildProcessError:
                    break
                if pid == worker:
                    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
                    code = 128 + sig if sig else os.WEXITSTATUS(status)
                    break
            os._exit(code)  # the kernel now kills every process left in the namespace
    import io
    import resource
    import traceback

    lim = spec["limits"]
    for res, val in (
        (resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1)),
        (resource.RLIMIT_AS, (lim["as"], lim["as"])),
        (resource.RLIMIT_FSIZE, (lim["fsize"], lim["fsize"])),
        (resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, val)
    nproc, mode = lim["nproc"], spec["nproc_mode"]
    if mode == "shared_uid":
        # RLIMIT_NPROC counts every process of the caller's uid: allow those plus `nproc`
        uid, mine = os.getuid(), 0
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/status") as f:
                        mine += any(ln.startswith("Uid:") and ln.split()[1] == str(uid) for ln in f)
                except OSError:
                    pass
        nproc += mine
    if mode != "none":
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if spec["uid"] >= 0:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    elif spec["drop_caps"]:
        _drop_capabilities()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, closefd=False)))

    def emit(**rec: Any) -> None:
        os.write(result_fd, (json.dumps({"token": token, **rec}) + "\n").encode())

    def describe(err: BaseException) -> str:
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return last[:500]

    def classify(err: BaseException) -> tuple[str, str]:
        if isinstance(err, MemoryError):
            return "killed", "memory limit (MemoryError)"
        if isinstance(err, BlockingIOError):  # EAGAIN from fork/clone: the process limit
            return "killed", f"process limit ({describe(err)})"
        if isinstance(err, RuntimeError) and "new thread" in str(err):
            return "killed", f"process limit ({describe(err)})"
        return "error", describe(err)

    program = spec["program"]
    tests = spec["tests"]
    if spec["audit_hook"]:
        _install_audit_hook(os.path.realpath(os.getcwd()))
    max_out = spec["max_output"]
    try:
        code = compile(program, "<program>", "exec")
    except (SyntaxError, ValueError, MemoryError) as err:
        status, reason = classify(err)
        emit(kind="done", status=status, reason=reason)
        sys.exit(0)
    fn_tests = [(i, t) for i, t in enumerate(tests) if isinstance(t, str)]
    io_tests = [(i, t) for i, t in enumerate(tests) if isinstance(t, dict)]
    failed = 0
    if fn_tests or not io_tests:
        scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(code, scope)
        except BaseException as err:  # noqa: BLE001 - the program's fault, reported as such
            if isinstance(err, SystemExit) and err.code in (None, 0) and not fn_tests:
                emit(kind="done", status="ok", reason="program exited with 0")
                sys.exit(0)
            status, reason = classify(err)
            emit(kind="done", status=status, reason=f"program: {reason}")
            sys.exit(0)
        for i, test in fn_tests:
            try:
                exec(compile(test, f"<test {i}>", "exec"), scope)
                emit(kind="test", name=f"test_{i}", passed=True)
            except MemoryError as err:
                emit(kind="test", name=f"test_{i}", passed=False, error=describe(err))
                emit(kind="done", status="killed", reason="memory limit (MemoryError)")
                sys.exit(0)
            except BaseException as err:  # noqa: BLE001
                failed += 1
                emit(kind="test", name=f"test_{i}", passed=False, error=describe(err))
    for i, test in io_tests:
        name = test.get("name") or f"test_{i}"
        real_out = sys.stdout
        buf = io.StringIO()
        sys.stdin, sys.stdout = io.StringIO(test["stdin"]), buf
        err_text = ""
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as err:
            if err.code not in (None, 0):
                err_text = f"exit code {err.code}"
        except BaseException as err:  # noqa: BLE001
            err_text = describe(err)
        finally:
            sys.stdout = real_out
        got = buf.getvalue()
        ok = not err_text and _norm_tokens(got) == _norm_tokens(test["expected_stdout"])
        if not ok and not err_text:
            err_text = f"wrong output: {got[:200]!r}"
        failed += not ok
        emit(kind="test", name=name, passed=ok, error=err_text)
        real_out.write(got[:max_out])
    emit(
        kind="done",
        status="failed" if failed else "ok",
        reason=f"{failed} of {len(tests)} tests failed" if failed else "all tests passed",
    )
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":  # pragma: no cover
    _child_main()
