"""The zygote of ``make grade``'s sandbox: one process, started once per grading run inside the
sandbox (``helpers.tools.sandbox``), that imports torch and the libraries every notebook needs,
then forks one process per notebook on request, isolates it further and runs it.

Standalone on purpose: it runs with ``python -I -S`` and imports no module of the course from the
environment; in the namespaces sandbox it preloads the part every notebook's copy shares (the
package and the checks' machinery, no lesson) from ``/course/active``, where each notebook's
process then mounts its own copy.

Per notebook (``mode``):

- ``namespaces``: the forked process unshares user, mount, PID, network, IPC and UTS namespaces;
  it sees its notebook's course copy only (the others are hidden under an empty tmpfs), a private
  ``/tmp`` and ``/dev/shm`` of bounded size, and no ``/proc``; the notebook runs as PID 1's only
  child in a PID namespace of its own, so that ending that PID 1 ends every process it started.
- ``user`` (root without namespaces): the notebook runs under a user id of its own, in a private
  folder holding its course copy; every process of that user is killed at the end.
- ``none``: the same user, a private folder, its own session; nothing is enforced.

Each gets resource limits (address space, processes, file size, CPU time) and its stdout and
stderr go to /dev/null. A *lifeline* pipe from the grader controls it: a byte ``i`` interrupts the
notebook (SIGINT, as a cell past its time limit), end of file kills it and everything it started.
"""

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 24, 38, 22, 2
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    """Raise OSError (errno and ``what``) when a C library call returned non-zero."""
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    """mount(2), strings encoded; OSError naming ``target`` when it fails."""
    enc = (lambda s: s.encode() if isinstance(s, str) else s)
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def preload(course: str | None, control: socket.socket) -> None:
    """What every notebook's process would import first, imported once here and inherited; with
    ``course`` (the namespaces sandbox: each notebook's copy is mounted there later), the course's
    package and the checks' machinery too (the same files in every copy), never a lesson."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # no CUDA driver before the forks
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (helpers.runtime)
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.utils.serialization  # noqa: F401  (torch.save of the first answer)
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryAccessor.enabled = False  # no sqlite history: nothing shared, nothing kept
    InteractiveShell.instance(config=config)  # its modules and set-up, once; each notebook's fork has its own
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Warm(TorchDispatchMode):  # the first dispatch mode of a process initialises torch._dynamo
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Warm():
        torch.zeros(1).add_(1)
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        pass
    if course:
        import importlib

        control.recv(64)  # the grader has written the course's copies
        sys.path.insert(0, course)
        for name in ("helpers", "helpers.checks.serving", "helpers.checks.calling", "helpers.checks.watchers",
                     "helpers.checks.probes"):
            importlib.import_module(name)
        del sys.path[0]
        lessons = [m for m in sys.modules if m.startswith("helpers.nb")]
        if lessons:
            raise ImportError(f"the preloaded machinery imported lessons: {lessons}")


def _limits(req: dict) -> None:
    """Resource limits of the notebook's process (and of what it starts)."""
    processes = req.get("processes") if req["mode"] == "user" else None  # a user id of its own: only its processes
    for name, value in (("RLIMIT_AS", req.get("address_space")), ("RLIMIT_NPROC", processes),
                        ("RLIMIT_FSIZE", req.get("file_size")), ("RLIMIT_CPU", req.get("cpu_s")),
                        ("RLIMIT_CORE", 0)):
        if value is not None and hasattr(resource, name):
            try:
                resource.setrlimit(getattr(resource, name), (int(value), int(value)))
            except (ValueError, OSError):
                pass


def _run_notebook(req: dict, grader_fd: int, judge_fd: int, course: str, work: str) -> None:
    """In the notebook's process: no output, its limits, its course copy first on the path; then
    the course's runner (``helpers.checks.serving``) runs the cells and answers the judge."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1) if req.get("debug") else (0, 1, 2):  # debug: stderr to the zygote's (the grader's)
        os.dup2(devnull, fd)
    os.close(devnull)
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    os.environ.update(HOME=work, TMPDIR=work if req["mode"] != "namespaces" else "/tmp",
                      MPLCONFIGDIR=os.path.join(work, ".matplotlib"), MPLBACKEND="agg")
    _limits(req)
    sys.path.insert(0, course)
    if req["mode"] != "namespaces":  # the preloaded machinery lives at another path: import the copy's
        for name in [m for m in sys.modules if m == "helpers" or m.startswith("helpers.")]:
            del sys.modules[name]
    import importlib

    importlib.import_module("helpers.checks.serving").run(grader_fd, judge_fd, int(req.get("threads", 1)))


def _watch(lifeline: int, pid: int, on_end, too_many=lambda tick: False) -> None:
    """Until ``pid`` ends: a byte ``i`` on the lifeline interrupts it, end of file kills it, and so
    does ``too_many(tick)`` turning true (asked five times a second)."""
    ticks = 0
    while True:
        ticks += 1
        if too_many(ticks):
            on_end()
            return
        ready, _, _ = select.select([lifeline], [], [], 0.2)
        if ready:
            data = os.read(lifeline, 64)
            if not data:
                on_end()
                return
            if b"i" in data:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            on_end()
            return


def _map_ids(uid: int, gid: int, proc: int | None = None) -> None:
    """In a new user namespace: the same user and group as outside (the zygote's: 1000, not root).
    ``proc``: a descriptor of /proc opened before it was hidden."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"self/{name}" if proc is not None else f"/proc/self/{name}", os.O_WRONLY, dir_fd=proc)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


# seccomp: no new user namespace (it would give the notebook capabilities again, and PID namespaces
# the process watcher cannot see), no memfd (memory outside every limit). (arch, unshare, clone,
# clone3, setns, memfd_create) syscall numbers, for x86_64 and aarch64; other machines get no filter.
_SYSCALLS = {"x86_64": (0xC000003E, 272, 56, 435, 308, 319), "aarch64": (0xC00000B7, 97, 220, 435, 268, 279)}


def _forbid_namespaces() -> None:
    """A seccomp filter: unshare and clone with a namespace flag, setns and memfd_create fail with
    EPERM, clone3 with ENOSYS (the C library then uses clone)."""
    numbers = _SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return
    arch, unshare, clone, clone3, setns, memfd = numbers
    namespaces = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
                  | CLONE_NEWCGROUP)
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ALLOW, _ERRNO | errno
    jge = 0x35  # BPF_JMP|JGE|K
    program = [  # (code, jump if true, jump if false, k); jumps skip that many instructions
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),  # 0-2: a call of another architecture (int 0x80)
        (ld, 0, 0, 0),  # 3: the syscall's number
        (jge, 7, 0, 0x40000000),  # 4: x32's numbers: to 12
        (jeq, 7, 0, unshare), (jeq, 6, 0, clone),  # 5-6: to 13, its flags
        (jeq, 3, 0, clone3),  # 7: to 11 (its flags are in memory a filter cannot read)
        (jeq, 3, 0, setns), (jeq, 2, 0, memfd),  # 8-9: to 12
        (ret, 0, 0, allow), (ret, 0, 0, enosys), (ret, 0, 0, eperm),  # 10-12
        (ld, 0, 0, 16), (jset, 0, 1, namespaces), (ret, 0, 0, eperm), (ret, 0, 0, allow),  # 13-16: the flags
    ]
    filters = (ctypes.c_ubyte * (8 * len(program)))()
    for i, (code, jt, jf, k) in enumerate(program):
        ctypes.memmove(ctypes.addressof(filters) + 8 * i, struct.pack("HBBI", code, jt, jf, k), 8)
    fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(filters))
    buf = ctypes.create_string_buffer(fprog)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, buf, 0, 0), "seccomp")


def _drop_capabilities() -> None:
    """No capability left, none to gain (the notebook needs none)."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: twice, all zero
    _check(_libc.capset(header, data), "capset")


def _namespaces(req: dict, grader_fd: int, judge_fd: int, lifeline: int) -> None:
    """The ``namespaces`` mode (module docstring): new namespaces, this notebook's course copy
    mounted read-only, private /tmp, no /proc; the notebook runs under a PID 1 of its own, watched
    here for its lifeline, its number of processes and threads and its memory."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare")
    _map_ids(uid, gid)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    stems, active = req["course_root"] + "/stems", req["course_root"] + "/active"
    _mount(f"{stems}/{req['stem']}", active, None, MS_BIND | MS_REC)
    _mount(None, active, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount("tmpfs", stems, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    scratch = f"size={int(req['scratch_bytes'])},mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, scratch)
    for index, path in req.get("keep", []):  # Python's folders that lived under /tmp
        os.makedirs(path, exist_ok=True)
        _mount(f"/sandbox/keep/{index}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, scratch)
    proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    _mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    # One more user and mount namespace: every mount made above is locked in it (it cannot be
    # unmounted to show what it covers), whatever capabilities the notebook has there.
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare (lock)")
    _map_ids(uid, gid, proc)
    init = os.fork()
    if init == 0:  # PID 1 of the new PID namespace: when it ends, every process in it ends
        os.close(proc)
        os.close(lifeline)
        notebook = os.fork()
        if notebook == 0:
            _drop_capabilities()
            _forbid_namespaces()
            _run_notebook(req, grader_fd, judge_fd, active, "/tmp/work")
            os._exit(0)
        for fd in (grader_fd, judge_fd):
            os.close(fd)
        signal.signal(signal.SIGINT, lambda *_: os.kill(notebook, signal.SIGINT))
        while True:
            try:
                pid, _ = os.wait()
            except ChildProcessError:
                os._exit(0)
            except InterruptedError:
                continue
            if pid == notebook:
                os._exit(0)
    for fd in (grader_fd, judge_fd):
        os.close(fd)
    processes, memory = int(req.get("processes") or 1 << 30), int(req.get("memory") or 1 << 62)

    def too_many(tick: int) -> bool:
        pids, tasks = _tasks(proc, init)
        if tasks > processes:  # counted five times a second, before a fork bomb fills the machine
            return True
        return tick % 5 == 0 and sum(_pss(proc, p) for p in pids) > memory  # once a second

    _watch(lifeline, init, lambda: _kill(init), too_many)


def _tasks(proc: int, init: int) -> tuple[list[str], int]:
    """The processes of the PID namespace of ``init`` and their processes and threads in all, read
    through ``proc`` (the zygote's /proc). Limits per process (RLIMIT_NPROC, RLIMIT_AS) do not
    bound these: the kernel does not hold root's processes to RLIMIT_NPROC (the sandbox's user is
    root outside when the grader is), and each process has its own address space."""
    try:
        ns = os.readlink(f"{init}/ns/pid", dir_fd=proc)
    except OSError:
        return [], 0
    pids, count = [], 0
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"{name}/ns/pid", dir_fd=proc) != ns:
                continue
            tasks = os.open(f"{name}/task", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc)
        except OSError:
            continue
        try:
            count += len(os.listdir(tasks))
            pids.append(name)
        except OSError:
            pass
        finally:
            os.close(tasks)
    return pids, count


def _pss(proc: int, pid: str) -> int:
    """A process's proportional share of resident memory, in bytes (pages shared with its parent
    after a fork, as DataLoader workers share, count once in all)."""
    try:
        fd = os.open(f"{pid}/smaps_rollup", os.O_RDONLY, dir_fd=proc)
    except OSError:
        return 0
    try:
        text = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and reap it (gone already: nothing to do)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _kill_user(uid: int) -> None:
    """Kill every process of ``uid`` (a process of that user may signal them all)."""
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            try:
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)
        os.waitpid(pid, 0)


def _user_or_none(req: dict, grader_fd: int, judge_fd: int, lifeline: int) -> None:
    """The ``user`` and ``none`` modes (module docstring): the course copy in a private folder, the
    notebook in a session of its own (under its own user id with ``uid``), watched for its lifeline."""
    home = req["private_dir"]
    course, work = os.path.join(home, "course"), os.path.join(home, "work")
    shutil.copytree(f"{req['course_root']}/stems/{req['stem']}", course, symlinks=False)
    os.makedirs(work)
    os.chmod(home, 0o700)
    uid = req.get("uid")
    if uid is not None:
        for folder, _, files in os.walk(home):
            os.chown(folder, uid, uid)
            for name in files:
                os.chown(os.path.join(folder, name), uid, uid)
    notebook = os.fork()
    if notebook == 0:
        os.setsid()
        if sys.platform == "linux":  # ends with its watcher, however that ends
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _run_notebook(req, grader_fd, judge_fd, course, work)
        os._exit(0)
    for fd in (grader_fd, judge_fd):
        os.close(fd)

    def end() -> None:
        if uid is not None:
            _kill_user(uid)
        else:
            try:
                os.killpg(notebook, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _kill(notebook)
        shutil.rmtree(home, ignore_errors=True)

    _watch(lifeline, notebook, end)


def _spawn(req: dict, fds: list[int], control: socket.socket) -> None:
    """In a process forked for one notebook: drop everything of the zygote's, then isolate."""
    grader_fd, judge_fd, lifeline = fds
    control.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    keep = sorted(fds)
    lo = 3
    for fd in keep:
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 1 << 16)
    if sys.platform == "linux":
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if req["mode"] == "namespaces":
        _namespaces(req, grader_fd, judge_fd, lifeline)
    else:
        _user_or_none(req, grader_fd, judge_fd, lifeline)


def _tell(grader_fd: int, e: BaseException) -> None:
    """A ``crash`` message on the notebook's channel to the grader (framed as multiprocessing's
    Connection frames it), when setting up the notebook's sandbox failed."""
    text = json.dumps({"type": "crash", "error": f"the sandbox could not start: {type(e).__name__}: {e}"[:300]})
    try:
        os.write(grader_fd, struct.pack("!i", len(text)) + text.encode())
    except OSError:
        pass


def main() -> None:
    """argv: the control socket's descriptor, the site folders (JSON), the course to preload (namespaces
    only). Preload, say ready (or why not), then fork one notebook's process per request."""
    control = socket.socket(fileno=int(sys.argv[1]))
    sys.path.extend(json.loads(sys.argv[2]))
    try:
        preload(sys.argv[3] if len(sys.argv) > 3 else None, control)
        control.send(json.dumps({"ready": True}).encode())
    except BaseException as e:  # noqa: BLE001 - the grader says why no notebook can run
        control.send(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"[:2000]}).encode())
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked notebooks are reaped by the kernel
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 3)
        except (OSError, ValueError):
            return
        if not msg:
            return
        req = json.loads(msg)
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _spawn(req, fds, control)
            except BaseException as e:  # noqa: BLE001 - the grader sees the notebook end: say why there
                _tell(fds[0], e)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    main()
