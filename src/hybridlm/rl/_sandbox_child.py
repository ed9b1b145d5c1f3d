"""The two child processes of one sandboxed run (see `hybridlm.rl.sandbox` for the design).

`python -I -S _sandbox_child.py program` is the *program process*: it builds the sandbox's
filesystem (when it starts in a mount namespace), becomes an unprivileged process, runs the
untrusted program and then serves requests about it: call this function, get this attribute, run
the program on this stdin. It never sees a test.

`python -I _sandbox_child.py judge` is the *judge*: a separate interpreter, outside the
sandbox's namespaces, that runs the trusted test code. The program's top-level names appear in
the judge as `Remote` handles; calling one sends the arguments to the program process and
returns the result decoded from plain data (None, bool, int, float, complex, str, bytes, list,
tuple, dict, set, frozenset) into fresh objects of exactly those types, so the program can
neither reach the judge's frames, builtins or tests, nor return an object with its own
`__eq__`. The judge alone writes the verdict, on a pipe the program never holds.

Standard library only, and cheap to import: both processes start once per run.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import struct
import sys
from typing import Any

MAX_FRAME = 8 << 20  # bytes in one message between judge and program
MAX_DEPTH = 64  # nesting of one encoded value
_HDR = struct.Struct(">I")


class ProtocolError(BaseException):
    """The program process broke the protocol, died, or sent something undecodable. A
    BaseException, so that test code catching `Exception` around a call cannot swallow it."""


# -- framing: a 4-byte big-endian length, then UTF-8 JSON --------------------------------------


def send(fd: int, msg: Any) -> None:
    data = json.dumps(msg, allow_nan=True, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_FRAME}")
    data = _HDR.pack(len(data)) + data
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise ProtocolError("the program process closed its end")
        buf += chunk
    return bytes(buf)


def recv(fd: int) -> Any:
    (n,) = _HDR.unpack(_read_exact(fd, _HDR.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"a message of {n} bytes exceeds {MAX_FRAME}")
    try:
        return json.loads(_read_exact(fd, n))
    except (ValueError, RecursionError) as err:
        raise ProtocolError(f"undecodable message: {type(err).__name__}") from None


# -- the value codec -----------------------------------------------------------------------------
# Tagged JSON: None/bool/str/float and machine-size ints are themselves; every container is a
# two-element list [tag, payload]; a big int is ["I", hex]. Anything else is a handle ["H", id,
# type name] (program -> judge) or a reference ["R", id] to a handle (judge -> program).

_BIG = 1 << 62


def encode(obj: Any, handle: Any, depth: int = 0) -> Any:
    """`obj` as tagged JSON; `handle(obj)` encodes what is not plain data (or raises)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH}")
    t = type(obj)
    if obj is None or t is bool or t is str or t is float:
        return obj
    if t is int:
        return obj if -_BIG < obj < _BIG else ["I", hex(obj)]
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "L", tuple: "T", set: "S", frozenset: "F"}[t]
        return [tag, [encode(x, handle, depth + 1) for x in obj]]
    if t is dict:
        return ["D", [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in
                      obj.items()]]  # fmt: skip
    if t is bytes or t is bytearray:
        return ["B" if t is bytes else "BA", obj.hex()]
    if t is complex:
        return ["C", [obj.real, obj.imag]]
    if t is range:
        return ["RG", [obj.start, obj.stop, obj.step]]
    return handle(obj)


def decode(obj: Any, handle: Any, depth: int = 0) -> Any:
    """Fresh plain objects from tagged JSON; `handle(tag, payload)` for "H" / "R" entries.
    Anything malformed raises `ProtocolError`."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"value nested deeper than {MAX_DEPTH}")
    t = type(obj)
    if obj is None or t is bool or t is str or t is float or t is int:
        return obj
    if t is not list or len(obj) < 2 or type(obj[0]) is not str:
        raise ProtocolError(f"malformed value of type {t.__name__}")
    tag, payload = obj[0], obj[1]
    try:
        if tag in ("L", "T", "S", "F"):
            items = [decode(x, handle, depth + 1) for x in _list(payload)]
            return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](items)
        if tag == "D":
            out = {}
            for pair in _list(payload):
                if type(pair) is not list or len(pair) != 2:
                    raise ProtocolError("malformed dict item")
                out[decode(pair[0], handle, depth + 1)] = decode(pair[1], handle, depth + 1)
            return out
        if tag == "I":
            return int(_str(payload), 16)
        if tag in ("B", "BA"):
            return (bytes if tag == "B" else bytearray).fromhex(_str(payload))
        if tag == "C":
            re_, im = _list(payload)
            return complex(_num(re_), _num(im))
        if tag == "RG":
            return range(*[int(_num(x)) for x in _list(payload)])
        if tag in ("H", "R", "M"):
            return handle(tag, obj[1:])
    except (TypeError, ValueError, OverflowError) as err:
        raise ProtocolError(f"malformed {tag!r} value: {err}") from None
    raise ProtocolError(f"unknown tag {tag!r}")


def _list(x: Any) -> list:
    if type(x) is not list:
        raise ProtocolError("expected a list")
    return x


def _str(x: Any) -> str:
    if type(x) is not str:
        raise ProtocolError("expected a str")
    return x


def _num(x: Any) -> float | int:
    if type(x) not in (int, float):
        raise ProtocolError("expected a number")
    return x


# -- the program process ---------------------------------------------------------------------------

_MS = {"rdonly": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "remount": 32, "bind": 4096,
       "rec": 16384}  # fmt: skip
# statvfs f_flag bit -> mount flag to keep on a read-only remount (the kernel refuses, inside a
# user namespace, to clear the flags a bind mount inherited)
_ST_TO_MS = {2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 1 << 21}
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc: Any, src: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:  # fmt: skip
    def enc(x: str | None) -> bytes | None:
        return x.encode() if x is not None else None

    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _keep_flags(path: str) -> int:
    flag = os.statvfs(path).f_flag
    return sum(ms for st, ms in _ST_TO_MS.items() if flag & st)


def _bind(libc: Any, src: str, dst: str, *, readonly: bool = True) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "w").close()
    _mount(libc, src, dst, None, _MS["bind"] | _MS["rec"])
    if readonly:
        flags = _MS["remount"] | _MS["bind"] | _MS["rdonly"] | _MS["nosuid"] | _MS["nodev"]
        _mount(libc, None, dst, None, flags | _keep_flags(src))


def build_root(base: str, plan: dict, uid: int) -> None:
    """In a private mount namespace: a tmpfs at `base` holding only `plan`'s read-only binds
    (the interpreter, its standard library, the shared libraries it loads), empty read-only
    tmpfs masks over site-packages, four device nodes, and a size-limited writable tmpfs at
    /sandbox (also /tmp); then `pivot_root` into it, detach the host's tree, remount the new root
    read-only and mount a fresh /proc (this PID namespace's processes only)."""
    import platform

    libc = _libc()
    nosuid_nodev = _MS["nosuid"] | _MS["nodev"]
    _mount(libc, "tmpfs", base, "tmpfs", nosuid_nodev, "size=1m,nr_inodes=4096,mode=0755")
    for src in plan["binds"]:
        _bind(libc, src, base + src)
    for link, target in plan["symlinks"]:  # their parents hold no symlink (see root_plan)
        if not os.path.lexists(base + link):
            os.makedirs(os.path.dirname(base + link), exist_ok=True)
            os.symlink(target, base + link)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
        if os.path.exists(dev):
            _bind(libc, dev, base + dev, readonly=dev != "/dev/null")
    for mask in plan["masks"]:
        if os.path.isdir(base + mask):
            _mount(libc, "tmpfs", base + mask, "tmpfs", nosuid_nodev | _MS["rdonly"], "size=4k")
    os.mkdir(base + "/sandbox")
    quota = f"size={plan['disk_mb']}m,nr_inodes={plan['inodes']},mode=0700,uid={uid},gid={uid}"
    _mount(libc, "tmpfs", base + "/sandbox", "tmpfs", nosuid_nodev, quota)
    os.symlink("/sandbox", base + "/tmp")
    os.mkdir(base + "/proc")
    if os.getpid() == 1:  # before the host's /proc is detached: the kernel wants one visible
        _mount(libc, "proc", base + "/proc", "proc", nosuid_nodev | _MS["noexec"])
    number = _PIVOT_ROOT.get(platform.machine())
    os.chdir(base)
    if number is not None:
        # pivot_root(".", "."): the old root ends up on top of the new one and is detached
        _check(libc.syscall(number, b".", b"."), "pivot_root")
        _check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH
    else:  # an architecture without a known syscall number: chroot (no capability left later)
        os.chroot(".")
    os.chdir("/")
    _mount(libc, None, "/", None, _MS["remount"] | _MS["bind"] | _MS["rdonly"] | nosuid_nodev)
    os.chdir("/sandbox")


def drop_bounding_set() -> None:
    """Empty the capability bounding set (needs CAP_SETPCAP: before any setuid)."""
    libc = _libc()
    cap = 0
    while libc.prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP
        cap += 1


def drop_capabilities() -> None:
    """Empty the bounding, effective, permitted and inheritable capability sets and set
    no_new_privs: uid 0 without capabilities cannot mount, kill other users' processes, ptrace,
    or override file permissions."""
    import ctypes

    libc = _libc()
    drop_bounding_set()
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    _check(libc.capset(header, data), "capset")
    _check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def become_nobody() -> None:
    """Root of a user namespace (an ordinary user's sandbox) becomes uid/gid 65534 ("nobody")
    of a nested user namespace that maps it to that root, i.e. to the caller's own uid outside:
    nothing inside runs as uid 0, even in appearance."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(0x10000000), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"65534 {uid} 1"),
                       ("gid_map", f"65534 {gid} 1")):  # fmt: skip
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


_BLOCKED_EVENTS = frozenset(
    {
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "os.symlink", "os.link",
        "os.chroot", "resource.setrlimit", "resource.prlimit", "ctypes.dlsym",
        "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "webbrowser.open",
    }
)  # fmt: skip


_PROC_SECRET = re.compile(r"^/proc/[^/]+/(task/\d+/)?(environ|mem|root|cwd|fd|map_files)(/|$)")


def install_audit_hook(root: str) -> None:
    """PEP 578 hook refusing sockets, process creation, ctypes calls and writes outside `root`.
    Defence in depth only: code in the same interpreter can get around it (the kernel layers and
    the judge are the boundary)."""
    import threading

    local = threading.local()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True
        p = os.path.realpath(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep) or p == os.devnull

    def hook(event: str, args: tuple) -> None:
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            if event in _BLOCKED_EVENTS or event.startswith("socket."):
                raise PermissionError(f"sandbox: {event} is not allowed")
            if event == "open":
                path, mode, flags = args
                # another process's environment or memory (weak mode shares the host's /proc)
                if isinstance(path, (str, bytes)) and _PROC_SECRET.match(
                    os.path.realpath(os.fsdecode(path))
                ):
                    raise PermissionError(f"sandbox: reading {path!r} is not allowed")
                writing = bool(flags & write_flags) or (
                    isinstance(mode, str) and any(c in mode for c in "wax+")
                )
                if writing and path is not None and not inside(path):
                    raise PermissionError(f"sandbox: writing {path!r} is not allowed")
            elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.replace",
                           "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
                           "shutil.move", "os.mkfifo", "os.mknod"):  # fmt: skip
                for arg in args[:2]:
                    if isinstance(arg, (str, bytes)) and not inside(arg):
                        raise PermissionError(f"sandbox: {event} on {arg!r} is not allowed")
        finally:
            local.busy = False

    sys.addaudithook(hook)


def _describe(err: BaseException) -> str:
    import traceback

    return traceback.format_exception_only(type(err), err)[-1].strip()[:500]


def _failure(err: BaseException) -> tuple[str, str]:
    """("killed", why) for a resource limit (memory, processes), else ("error", description)."""
    if isinstance(err, MemoryError):
        return "killed", "memory limit (MemoryError)"
    if isinstance(err, BlockingIOError) or (  # EAGAIN from fork/clone
        isinstance(err, RuntimeError) and "new thread" in str(err)
    ):
        return "killed", f"process limit ({_describe(err)})"
    return "error", _describe(err)


_BUILTIN_NAMES = frozenset(dir(builtins))


class _Program:
    """The program process's request loop: executes the program once, then answers the judge."""

    def __init__(self, source: str, req_fd: int, resp_fd: int, max_output: int) -> None:
        self.source, self.req_fd, self.resp_fd = source, req_fd, resp_fd
        self.max_output = max_output
        self.objects: dict[int, Any] = {}
        self.scope: dict[str, Any] = {}

    def handle(self, obj: Any) -> Any:
        key = id(obj)
        self.objects[key] = obj
        return ["H", key, type(obj).__name__[:100]]

    def ref(self, tag: str, rest: list) -> Any:
        if tag != "R" or not rest or rest[0] not in self.objects:
            raise ProtocolError(f"unknown reference {rest!r}")
        return self.objects[rest[0]]

    def value(self, obj: Any) -> Any:
        return encode(obj, self.handle)

    def names(self) -> dict[str, Any]:
        out = {}
        for name, obj in self.scope.items():
            if name.startswith("__"):
                continue
            if name in _BUILTIN_NAMES:
                continue  # the judge's `abs`, `len`, `sorted`... are never the program's
            if type(obj).__name__ == "module":
                if getattr(obj, "__name__", "") == name:  # `import math`, not `import x as math`
                    out[name] = ["M", name]
            else:
                try:
                    out[name] = self.value(obj)
                except ValueError:
                    out[name] = self.handle(obj)
        return out

    def answer(self, req: dict) -> dict:
        op = req.get("op")
        if op == "start":
            if req.get("exec"):
                self.scope = {"__name__": "__main__", "__builtins__": builtins}
                code = compile(self.source, "<program>", "exec")
                try:
                    exec(code, self.scope)
                except SystemExit as err:  # sys.exit(0) ends the program; its names stay
                    if err.code not in (None, 0):
                        raise
            return {"ok": self.names()}
        if op == "stdio":
            return self.stdio(req.get("stdin", ""))
        target = self.ref("R", [req.get("h")])
        if op == "call":
            args = decode(req.get("args", ["L", []]), self.ref)
            kwargs = decode(req.get("kwargs", ["D", []]), self.ref)
            result = target(*args, **kwargs)
            # copy-out: in-place changes to list / dict / set / bytearray arguments
            after = [self.value(a) if type(a) in (list, dict, set, bytearray) else None
                     for a in args]  # fmt: skip
            return {"ok": self.value(result), "args": after}
        if op == "getattr":
            return {"ok": self.value(getattr(target, str(req.get("name"))))}
        if op == "iter":
            return {"ok": self.value(iter(target))}
        if op == "next":
            try:
                return {"ok": self.value(next(target))}
            except StopIteration:
                return {"stop": True}
        if op == "len":
            return {"ok": len(target)}
        if op == "getitem":
            return {"ok": self.value(target[decode(req.get("key"), self.ref)])}
        if op == "contains":
            return {"ok": decode(req.get("key"), self.ref) in target}
        if op == "str":
            return {"ok": (repr if req.get("repr") else str)(target)[:10_000]}
        raise ProtocolError(f"unknown request {op!r}")

    def stdio(self, stdin: str) -> dict:
        import io

        real_in, real_out = sys.stdin, sys.stdout
        buf = io.StringIO()
        sys.stdin, sys.stdout = io.StringIO(stdin), buf
        error, kind = "", ""
        try:
            exec(compile(self.source, "<program>", "exec"),
                 {"__name__": "__main__", "__builtins__": builtins})  # fmt: skip
        except SystemExit as err:
            if err.code not in (None, 0):
                error, kind = f"exit code {err.code}", "error"
        except BaseException as err:  # noqa: BLE001 - the program's fault, reported as data
            kind, error = _failure(err)
        finally:
            sys.stdin, sys.stdout = real_in, real_out
        out = buf.getvalue()
        real_out.write(out[: self.max_output])
        return {"stdout": out[: 4 << 20], "error": error, "kind": kind}

    def serve(self) -> None:
        while True:
            try:
                req = recv(self.req_fd)
            except ProtocolError:
                return
            if not isinstance(req, dict) or req.get("op") == "exit":
                return
            try:
                resp = self.answer(req)
            except BaseException as err:  # noqa: BLE001
                kind, why = _failure(err)
                resp = {"exc": [type(err).__name__[:100], why, kind]}
            try:
                send(self.resp_fd, resp)
            except ValueError:
                send(self.resp_fd, {"exc": ["ValueError", "result too large", "error"]})


def program_main() -> None:  # pragma: no cover - runs in the sandboxed child
    spec = json.loads(sys.stdin.buffer.read())
    if spec["cgroup"]:  # join the pids cgroup before anything can fork
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    uid = spec["uid"]
    if spec["root"] is not None:
        build_root(spec["root"]["base"], spec["root"], max(uid, 0))
    if os.getpid() == 1:
        # PID-namespace init: the kernel ignores most signals sent to init, so the program runs
        # in a child; init reaps everything and reports the worker's fate as an exit code.
        worker = os.fork()
        if worker:
            os.closerange(3, 1 << 16)
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
    import resource

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
        mine, me = 0, str(os.getuid())
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/status") as f:
                        mine += any(ln.startswith("Uid:") and ln.split()[1] == me for ln in f)
                except OSError:
                    pass
        nproc += mine
    if mode != "none":
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if uid >= 0:
        drop_bounding_set()
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif spec["nested_user"]:
        become_nobody()
    if spec["drop_caps"]:
        drop_capabilities()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    import io

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, closefd=False)))
    for name, text in spec["files"].items():
        with open(name, "w") as f:
            f.write(text)
    if spec["audit_hook"]:
        install_audit_hook(os.path.realpath(os.getcwd()))
    prog = _Program(spec["program"], spec["req_fd"], spec["resp_fd"], spec["max_output"])
    spec = None  # nothing but the program's own source stays reachable from here
    prog.serve()
    for stream in (sys.stdout, sys.stderr):  # os._exit skips the interpreter's own flush
        try:
            stream.flush()
        except (OSError, ValueError):  # the program closed or broke it
            pass
    os._exit(0)


# -- the judge ---------------------------------------------------------------------------------


class RemoteError(Exception):
    """An exception the program raised, of a type the judge does not recreate."""


class Remote:
    """A handle to an object living in the program process. Calls, attribute reads, iteration,
    `len`, indexing and `in` are forwarded and their results come back as plain data. It has no
    truth value and compares equal only to itself: the program cannot make it equal anything."""

    __slots__ = ("_conn", "_id", "_type")

    def __init__(self, conn: _Conn, key: int, type_name: str) -> None:
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_id", key)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._conn.call(self, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._conn.ask({"op": "getattr", "h": self._id, "name": name})

    def __iter__(self) -> Any:
        it = self._conn.ask({"op": "iter", "h": self._id})
        return it if isinstance(it, Remote) else iter(it)

    def __next__(self) -> Any:
        return self._conn.ask({"op": "next", "h": self._id})

    def __len__(self) -> int:
        n = self._conn.ask({"op": "len", "h": self._id})
        if type(n) is not int:
            raise TypeError("len() of a remote object did not return an int")
        return n

    def __getitem__(self, key: Any) -> Any:
        return self._conn.ask({"op": "getitem", "h": self._id, "key": self._conn.arg(key)})

    def __contains__(self, key: Any) -> bool:
        return self._conn.ask({"op": "contains", "h": self._id, "key": self._conn.arg(key)}) is True

    def __bool__(self) -> bool:
        raise TypeError(f"a {self._type} object from the program has no truth value here")

    def __str__(self) -> str:
        return str(self._conn.ask({"op": "str", "h": self._id}))

    def __repr__(self) -> str:
        return f"<{self._type} from the program>"


_SAFE_MODULES = frozenset(getattr(sys, "stdlib_module_names", ())) - {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser", "pydoc",
    "ensurepip", "venv", "lib2to3", "pdb", "code", "pty", "tty",
}  # fmt: skip


class _Conn:
    """The judge's end of the pipes to the program process."""

    def __init__(self, req_fd: int, resp_fd: int) -> None:
        self.req_fd, self.resp_fd = req_fd, resp_fd
        self.dead: str = ""

    def handle(self, tag: str, rest: list) -> Any:
        if tag == "H" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) is str:
            return Remote(self, rest[0], rest[1])
        if tag == "M" and len(rest) == 1 and type(rest[0]) is str:
            # a module the program imported: the judge imports its own copy (standard library)
            top = rest[0].partition(".")[0]
            if top in _SAFE_MODULES:
                import importlib

                return importlib.import_module(rest[0])
            return None
        raise ProtocolError(f"unexpected {tag!r} entry")

    def arg(self, obj: Any) -> Any:
        def ref(x: Any) -> Any:
            if isinstance(x, Remote):
                return ["R", x._id]
            raise TypeError(f"cannot pass a {type(x).__name__} to the program")

        return encode(obj, ref)

    def request(self, msg: dict) -> dict:
        if self.dead:
            raise ProtocolError(self.dead)
        try:
            send(self.req_fd, msg)
            resp = recv(self.resp_fd)
        except (OSError, ProtocolError) as err:
            self.dead = f"the program process died ({err})"
            raise ProtocolError(self.dead) from None
        if not isinstance(resp, dict):
            self.dead = "malformed response"
            raise ProtocolError(self.dead)
        return resp

    @staticmethod
    def _ok(resp: dict, *, stop: bool = False) -> Any:
        """A response's encoded value; the program's exception raised, and with `stop` (only
        for "next") the end of iteration. A StopIteration anywhere else could end a judge-side
        `map` or generator early, so there it is a protocol error."""
        if "exc" in resp:
            raise _exception(resp["exc"])
        if stop and resp.get("stop") is True:
            raise StopIteration
        if "ok" not in resp:
            raise ProtocolError("malformed response")
        return resp["ok"]

    def ask(self, msg: dict) -> Any:
        resp = self.request(msg)
        return decode(self._ok(resp, stop=msg.get("op") == "next"), self.handle)

    def call(self, target: Remote, args: tuple, kwargs: dict) -> Any:
        msg = {"op": "call", "h": target._id, "args": self.arg(list(args)),
               "kwargs": self.arg(dict(kwargs))}  # fmt: skip
        resp = self.request(msg)
        value = self._ok(resp)
        after = resp.get("args")
        if type(after) is list and len(after) == len(args):
            for mine, theirs in zip(args, after, strict=True):  # copy-out of in-place changes
                if theirs is None or type(mine) not in (list, dict, set, bytearray):
                    continue
                new = decode(theirs, self.handle)
                if type(new) is not type(mine):
                    continue
                if isinstance(mine, list | bytearray):
                    mine[:] = new
                else:
                    mine.clear()
                    mine.update(new)
        return decode(value, self.handle)


class _ProgramFailure(BaseException):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _exception(exc: Any) -> BaseException:
    """The judge's own exception object for one the program raised (builtin Exception types by
    name, else `RemoteError`); "killed" failures (memory, processes) end the run."""
    if type(exc) is not list or len(exc) != 3 or not all(type(x) is str for x in exc):
        return ProtocolError("malformed exception")
    name, message, kind = exc
    if kind == "killed":
        return _ProgramFailure("killed", message)
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls is not StopIteration:
        try:
            return cls(message.partition(": ")[2] or message)
        except Exception:  # noqa: BLE001 - constructors with other signatures
            pass
    return RemoteError(message)


def judge_main() -> None:  # pragma: no cover - runs in the judge process
    spec = json.loads(sys.stdin.buffer.read())
    verdict_fd = spec["verdict_fd"]
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, no /proc/*/mem
    except (OSError, AttributeError):
        pass
    import resource

    cpu = spec["cpu"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def emit(**rec: Any) -> None:
        os.write(verdict_fd, (json.dumps(rec) + "\n").encode())

    conn = _Conn(spec["req_fd"], spec["resp_fd"])
    tests = spec["tests"]
    code_tests = [t for t in tests if t["kind"] == "code"]
    stdio_tests = [t for t in tests if t["kind"] == "stdio"]
    try:
        resp = conn.request({"op": "start", "exec": bool(code_tests) or not stdio_tests})
        if "exc" in resp:
            exc = resp["exc"]
            ok = type(exc) is list and len(exc) == 3 and all(type(x) is str for x in exc)
            kind, why = (exc[2], exc[1]) if ok else ("error", "malformed exception")
            emit(kind="done", status="killed" if kind == "killed" else "error",
                 reason=f"program: {why}", died=False)  # fmt: skip
            return
        raw = resp.get("ok")
        if type(raw) is not dict or len(raw) > 10_000:
            raise ProtocolError("malformed names")
        names = {}
        for key, value in raw.items():
            # checked here, not trusted from the program process: no dunders (`__builtins__`),
            # nothing shadowing the judge's builtins, modules only under their own name
            if not key.isidentifier() or key.startswith("__") or key in _BUILTIN_NAMES:
                continue
            if type(value) is list and value[:1] == ["M"] and value[1:] != [key]:
                continue
            names[key] = decode(value, conn.handle)
    except ProtocolError as err:
        emit(kind="done", status="error", reason=f"program: {err}", died=True)
        return
    failed, stopped = 0, None
    scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, **names}
    for i, test in enumerate(tests):
        name = test.get("name") or f"test_{i}"
        if stopped is not None:
            failed += 1
            emit(kind="test", name=name, passed=False, error=stopped.args[0])
            continue
        try:
            if test["kind"] == "code":
                if test.get("setup"):  # trusted helpers (e.g. a prompt's) override the program's
                    exec(compile(test["setup"], f"<setup {i}>", "exec"), scope)
                exec(compile(test["code"], f"<test {i}>", "exec"), scope)
                ok, error = True, ""
            else:
                resp = conn.request({"op": "stdio", "stdin": test["stdin"]})
                out, error, kind = resp.get("stdout"), resp.get("error"), resp.get("kind")
                if type(out) is not str or type(error) is not str:
                    raise ProtocolError("malformed stdio response")
                if kind == "killed":
                    raise _ProgramFailure("killed", error)
                ok = not error and out.split() == test["expected_stdout"].split()
                if not ok and not error:
                    error = f"wrong output: {out[:200]!r}"
        except (_ProgramFailure, ProtocolError) as err:
            stopped = err
            ok, error = False, str(err)
        except BaseException as err:  # noqa: BLE001 - a failing test
            ok, error = False, _describe(err)
        if conn.dead and stopped is None:  # the test caught the failure: it still counts
            stopped = ProtocolError(conn.dead)
            ok, error = False, conn.dead
        failed += not ok
        emit(kind="test", name=name, passed=ok, error=error)
    if isinstance(stopped, _ProgramFailure):
        emit(kind="done", status=stopped.kind, reason=str(stopped), died=False)
    elif stopped is not None:
        emit(kind="done", status="error", reason=str(stopped), died=True)
    else:
        emit(
            kind="done",
            status="failed" if failed else "ok",
            reason=f"{failed} of {len(tests)} tests failed" if failed else "all tests passed",
            died=False,
        )
    try:
        send(spec["req_fd"], {"op": "exit"})
    except OSError:
        pass


if __name__ == "__main__":  # pragma: no cover
    {"program": program_main, "judge": judge_main}[sys.argv[1]]()
