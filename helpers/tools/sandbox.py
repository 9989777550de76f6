"""Where ``make grade`` runs a notebook: an operating-system sandbox that holds nothing to forge from.

Three kinds, the best this machine allows (:func:`detect`), named in the gradebook's ``sandbox``
column:

- ``namespaces`` (Linux with bubblewrap and user namespaces): one *zygote* process
  (``sandbox_zygote.py``) starts inside ``bwrap`` with a read-only view of the system and of
  Python's environment (the course's installed package hidden), no network, no view of the
  grader's files, the submissions, the gradebook or the grader's processes; for each notebook it
  forks a process that unshares its own namespaces and sees only its notebook's course copy, a
  private ``/tmp`` and no ``/proc``, under resource limits.
- ``user`` (root without user namespaces, e.g. some containers): each notebook runs under a user
  id of its own, in a private folder, under the same limits. It can read what that user can read:
  :func:`readable_secrets` names the course's files it could, and each of its rows says so.
- ``none``: nothing is enforced; every row is marked for review with the reason.

The course copy (:func:`build_course`) holds the lessons a notebook imports and the checks'
machinery, not the checks, the references of the notebook's exercises, ``solutions/`` or the grader.
"""

from __future__ import annotations

import ast
import compileall
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .copies import HELPERS, forbidden_references  # HELPERS: the course's package folder

KINDS = ("namespaces", "user", "none")
# What the sandbox's copy of helpers/checks holds: the machinery a protected call and the watchers
# need. The checks themselves (expected values, mistake models) stay with the judge.
MACHINERY = ("calling.py", "guard.py", "feedback.py", "instruments.py", "probes.py", "watchers.py", "serving.py")
CHECKS_STUB = '''"""In ``make grade``'s sandbox: the grader runs the checks itself, outside the notebook."""


MODULES = {MODULES}


def __getattr__(name):
    if name.startswith("__") or name in MODULES:  # a module of the machinery: imported, not a check
        raise AttributeError(name)

    def check(*args, **kwargs):
        print(f"checks.{name}: the grader runs this check itself, outside the notebook.")

    return check
'''
# Lesson functions of a notebook's own modules that its exercise notebook imports (they are not
# answers): every other function of those modules is left out of that notebook's sandbox.
LESSON_IMPORTS = {"08_flops_memory": {"dense_param_count"}}
READY_TIMEOUT_S = 300  # for the zygote to import torch and preload the course's machinery
UID_BASE = 0x5A000000  # user ids of notebooks in the ``user`` sandbox: UID_BASE + 65536 * (pid % 4096) + a counter


@dataclass
class Isolation:
    """The sandbox a grading run uses, and why not a better one."""

    kind: str  # one of KINDS
    reason: str = ""  # why not a better one


def _bwrap() -> str | None:
    """bubblewrap's path, or None where it is not installed."""
    return shutil.which("bwrap")


def detect(asked: str = "auto") -> Isolation:
    """The sandbox this machine gives (``asked`` one of ``auto`` and :data:`KINDS`). Asking for a
    kind the machine cannot give is an error with the reason."""
    if asked not in ("auto", *KINDS):
        raise ValueError(f"unknown sandbox {asked!r}: one of auto, {', '.join(KINDS)}")
    why = ""
    if asked in ("auto", "namespaces"):
        if sys.platform != "linux":
            why = f"namespaces need Linux (this is {sys.platform})"
        elif not _bwrap():
            why = "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        else:
            # What the zygote and each notebook need: --size (bubblewrap 0.7+, not setuid) and a
            # user namespace inside the sandbox.
            nested = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x10000000 | 0x20000) != 0)"
            probe = subprocess.run([_bwrap(), "--unshare-user", "--uid", "1000", "--gid", "1000", "--unshare-pid",
                                    "--unshare-net", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
                                    "--size", str(1 << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/",
                                    sys.executable, "-I", "-S", "-c", nested], capture_output=True, text=True)
            if probe.returncode == 0:
                return Isolation("namespaces")
            why = f"bubblewrap cannot create namespaces here ({(probe.stderr.strip() or 'exit status ' + str(probe.returncode))[:200]})"
        if asked == "namespaces":
            raise OSError(f"no namespaces sandbox: {why}")
    if asked in ("auto", "user"):
        hidden = [p for p in sorted(_prefixes()) if not _world_readable(Path(p))]
        if sys.platform == "linux" and os.geteuid() == 0 and not hidden:
            return Isolation("user", why)
        if asked == "user":
            raise OSError("no user sandbox: it needs root (to run each notebook under a user id of its own)"
                          if os.geteuid() != 0 else f"no user sandbox: other users cannot read Python's {hidden[0]}")
        also = "not root" if os.geteuid() != 0 else f"other users cannot read Python's {hidden[0]}"
        why = f"{why}; {also}, so no user of its own either" if why else also
    return Isolation("none", why or "asked for")


# --------------------------------------------------------------------------- the course copy


_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def _names_in(nodes) -> set[str]:
    """The names read or bound anywhere in ``nodes`` (None entries skipped: absent defaults)."""
    return {n.id for node in nodes if node is not None for n in ast.walk(node) if isinstance(n, ast.Name)}


def import_time(tree: ast.Module) -> set[str]:
    """The module's functions that run when it is imported (called by top-level code, decorators,
    default values, class bodies, and what those call): a stub there would break the import."""
    functions = {n.name: n for n in tree.body if isinstance(n, _FUNCTION)}
    used: set[str] = set()
    for node in tree.body:
        if isinstance(node, _FUNCTION):
            used |= _names_in([*node.decorator_list, *node.args.defaults, *node.args.kw_defaults])
        elif isinstance(node, ast.ClassDef):
            used |= _names_in([*node.decorator_list, *node.bases,
                               *(n for n in node.body if not isinstance(n, _FUNCTION))])
        else:
            used |= _names_in([node])
    found, todo = set(), sorted(used & set(functions))
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += sorted(_names_in([functions[name]]) & set(functions) - found)
    return found


def _own_or_later(module_file: str, stem: str) -> bool:
    """Is this lesson module (``nbMM_*``) of notebook ``stem`` or of a later one? Later notebooks'
    functions build on this one's answers (notebook 11's attention block computes 5.1)."""
    m = re.match(r"nb(\d\d)_", module_file)
    return bool(m) and int(m.group(1)) >= int(stem[:2])


@functools.cache
def _parsed(source: str) -> ast.Module:
    return ast.parse(source)


def _stub(name: str, qualname: str, stem: str, indent: str) -> list[str]:
    text = (f"`{qualname}` is not in the grader's sandbox while it grades {stem}: it is, or builds on, the "
            "course's answer to an exercise of this notebook.")
    return [f"{indent}def {name}(*args, **kwargs):\n", f"{indent}    raise RuntimeError({text!r})\n"]


def _stripped(source: str, stem: str, module: str, exercise_names: set[str]) -> str:
    """A lesson module's source for ``stem``'s sandbox: functions named like one of its exercises or
    like a helper its checks forbid go everywhere; in the modules of this notebook and of later
    ones, every function but its lesson imports and what runs at import (:func:`import_time`), and
    every method of their classes but the special ones (``__init__``), are stubs that say why."""
    tree = _parsed(source)
    names = set(exercise_names)
    own = _own_or_later(module.split(".")[-1], stem)
    if own:
        names |= {n.name for n in tree.body if isinstance(n, _FUNCTION)}
        names -= LESSON_IMPORTS.get(stem, set()) | (import_time(tree) - set(exercise_names))
    spans = []  # (first line, last line, stub lines), 1-based, decorators included
    for node in tree.body:
        if isinstance(node, _FUNCTION) and node.name in names:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.append((first, node.end_lineno, _stub(node.name, f"{module}.{node.name}", stem, "")))
        elif isinstance(node, ast.ClassDef) and own:
            for m in node.body:
                if isinstance(m, _FUNCTION) and not m.name.startswith("__"):
                    first = min([m.lineno, *(d.lineno for d in m.decorator_list)])
                    indent = " " * m.col_offset
                    spans.append((first, m.end_lineno, _stub(m.name, f"{module}.{node.name}.{m.name}", stem, indent)))
    if not spans:
        return source
    lines = source.splitlines(keepends=True)
    for first, last, stub in sorted(spans, reverse=True):
        lines[first - 1:last] = stub
    return "".join(lines)


def _lesson_functions(source: str) -> set[str]:
    return {n.name for n in _parsed(source).body if isinstance(n, _FUNCTION)}


def build_course(root: Path, stems: dict[str, list[str]]) -> Path:
    """Write ``root/stems/<stem>/helpers`` for every notebook stem (its exercises' names given),
    byte-compiled, and ``root/active/helpers``, the part every copy shares that the zygote preloads
    (where each notebook's process then mounts its own copy). Files
    that are the same for every notebook are written and compiled once (beside ``root``, removed
    after: it holds every reference) and hard-linked."""
    common = root.parent / f"{root.name}-common"
    try:
        _build(root, common, stems)
    finally:
        shutil.rmtree(common, ignore_errors=True)  # it holds every reference
    for folder, _, names in os.walk(root):  # the sandbox's user is this one (namespaces) or root copies it (user)
        os.chmod(folder, 0o700)
        for name in names:
            os.chmod(os.path.join(folder, name), 0o600)
    return root


def _build(root: Path, common: Path, stems: dict[str, list[str]]) -> None:
    """build_course's work: every file of the course copied once into ``common`` (byte-compiled),
    then each stem's copy and ``root/active`` made of links to those files or stripped versions."""
    files = []
    for path in sorted(HELPERS.rglob("*")):
        rel = path.relative_to(HELPERS)
        parts = rel.parts
        if "__pycache__" in parts or path.is_dir() or parts[0] == "tools" or rel.name == "reference.py" \
                or rel.name == "model_answers.json" or (parts[0] == "checks" and rel.name not in MACHINERY) \
                or (parts[0] == "results" and len(parts) > 2):  # results/repeats/: earlier runs
            continue
        target = common / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        lesson = path.suffix == ".py" and parts[0] != "checks"
        files.append((rel, _lesson_functions(target.read_text(encoding="utf-8")) if lesson else set()))
    stub = CHECKS_STUB.replace("{MODULES}", repr(sorted(m[:-3] for m in MACHINERY)))
    (common / "checks").mkdir(exist_ok=True)
    (common / "checks" / "__init__.py").write_text(stub, encoding="utf-8")
    compileall.compile_dir(str(common), quiet=2, workers=1)
    forbidden = forbidden_references()
    for stem, exercise_names in stems.items():
        exercise_names = sorted({*exercise_names, *(n for e in exercise_names for n in forbidden.get(e, ()))})
        dest = root / "stems" / stem / "helpers"
        for folder in sorted({common / rel.parent for rel, _ in files} | {common / "checks"}):
            (dest / folder.relative_to(common)).mkdir(parents=True, exist_ok=True)
            if (folder / "__pycache__").is_dir():
                (dest / folder.relative_to(common) / "__pycache__").mkdir(exist_ok=True)
        for rel, functions in [*files, (Path("checks/__init__.py"), set())]:
            source, target = common / rel, dest / rel
            own = _own_or_later(rel.name, stem)
            if functions & set(exercise_names) or own:
                module = "helpers." + ".".join(rel.with_suffix("").parts)
                text = _stripped(source.read_text(encoding="utf-8"), stem, module, set(exercise_names))
                target.write_text(text, encoding="utf-8")  # compiled when imported: most never are
                continue
            os.link(source, target)
            if rel.suffix == ".py":
                cached = Path(importlib.util.cache_from_source(str(source)))
                if cached.exists():
                    os.link(cached, Path(importlib.util.cache_from_source(str(target))))
    # What every notebook's process imports before its own copy is in place (the zygote preloads it
    # from here, and each copy holds the same files at the same paths): no lesson, no reference.
    for rel in ["__init__.py", "runtime.py", "registry.py", *(f"checks/{m}" for m in ["__init__.py", *MACHINERY])]:
        target = root / "active" / "helpers" / rel
        (target.parent / "__pycache__").mkdir(parents=True, exist_ok=True)
        os.link(common / rel, target)
        cached = Path(importlib.util.cache_from_source(str(common / rel)))
        if cached.exists():
            os.link(cached, Path(importlib.util.cache_from_source(str(target))))


def readable_secrets() -> list[str]:
    """The course's files that any user can read (for the ``user`` sandbox, which runs notebooks as
    an ordinary user): the lesson modules (they hold the references), the checks, the model
    answers, solutions/ beside an editable install."""
    found = []
    candidates = [HELPERS / "reference.py", HELPERS / "checks" / "core.py", HELPERS / "model_answers.json",
                  *sorted(HELPERS.glob("nb[0-9][0-9]_*.py")), HELPERS.parent / "solutions"]
    for path in candidates:
        if path.exists() and _world_readable(path):
            found.append(str(path))
    return found


def _world_readable(path: Path) -> bool:
    """Can any user read ``path`` (and pass through every folder above it)?"""
    for p in [path, *path.parents]:
        try:
            mode = p.stat().st_mode
        except OSError:
            return False
        if p == path and not mode & stat.S_IROTH:
            return False
        if p != path and not mode & stat.S_IXOTH:
            return False
    return True


# --------------------------------------------------------------------------- the zygote


def _site_dirs() -> list[str]:
    """Where this Python finds installed packages (the zygote runs with ``-S`` and adds these)."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("purelib", "platlib")]
    found += [p for p in sys.path if ("site-packages" in p or "dist-packages" in p) and os.path.isdir(p)]
    return list(dict.fromkeys(os.path.abspath(p) for p in found if os.path.isdir(p)))


def _prefixes() -> set[str]:
    """Python's own folders: the environment's, the installation it was made from."""
    return {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}


def _under_tmp(path: str) -> bool:
    return path == "/tmp" or path.startswith("/tmp/")


def _keep() -> list[list]:
    """Python's folders under /tmp (a test's or a throw-away environment), which each notebook's
    private /tmp would hide: [[index, path]] for the notebook to bind back."""
    return [[i, p] for i, p in enumerate(sorted(_prefixes())) if _under_tmp(p)]


def _bwrap_args(course: Path, zygote: Path) -> list[str]:
    args = [_bwrap(), "--unshare-user", "--uid", "1000", "--gid", "1000", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--proc", "/proc", "--dev", "/dev", "--size", str(64 << 20), "--tmpfs", "/tmp",
            "--size", str(16 << 20), "--tmpfs", "/dev/shm"]
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group",
                 "/etc/nsswitch.conf", "/etc/localtime", "/etc/fonts", "/etc/ssl", "/sys"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for dev in sorted(Path("/dev").glob("nvidia*")):
        args += ["--dev-bind", str(dev), str(dev)]
    prefixes = _prefixes()
    for i, prefix in enumerate(sorted(prefixes)):
        args += ["--ro-bind", prefix, prefix]
        if _under_tmp(prefix):  # hidden by each notebook's own /tmp: the notebook binds it back from here
            args += ["--ro-bind", prefix, f"/sandbox/keep/{i}"]
    for site in _site_dirs():
        if not site.startswith(tuple(prefixes)):
            args += ["--ro-bind", site, site]
        if os.path.isdir(os.path.join(site, "helpers")):  # the course, installed: not in the sandbox
            args += ["--tmpfs", os.path.join(site, "helpers")]
    args += ["--ro-bind", str(course), "/course", "--ro-bind", str(zygote), "/sandbox/zygote.py",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--chdir", "/tmp"]
    for name in ("TRITON_INTERPRET", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        if name in os.environ:
            args += ["--setenv", name, os.environ[name]]
    return [*args, "--remount-ro", "/"]  # the sandbox's own root folder too: nothing shared to write in


class Zygote:
    """The sandbox's zygote: :meth:`launch` (it imports torch meanwhile), :meth:`build` the course
    copies, :meth:`wait_ready`; then one :meth:`spawn` per notebook; :meth:`close`."""

    def __init__(self, isolation: Isolation, limits: dict):
        self.isolation, self.limits = isolation, limits
        self.tmp = Path(tempfile.mkdtemp(prefix="grade-sandbox-"))
        os.chmod(self.tmp, 0o711)
        self.course = self.tmp / "course"
        self.course.mkdir()
        self.private = self.tmp / "notebooks"
        self.private.mkdir(mode=0o711)
        self.count = 0
        self.process: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.log = None  # the zygote's stderr, read when it fails to start (None with the debug limit: the grader's)
        self.course_root = "/course" if isolation.kind == "namespaces" else str(self.course)

    def launch(self) -> None:
        """Start the zygote (inside bubblewrap for ``namespaces``), which imports torch meanwhile."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zygote = Path(__file__).with_name("sandbox_zygote.py")
        python = [sys.executable, "-I", "-S"]
        if self.isolation.kind == "namespaces":
            cmd = [*_bwrap_args(self.course, zygote), *python, "/sandbox/zygote.py"]
        else:
            cmd = [*python, str(zygote)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        preload = ["/course/active"] if self.isolation.kind == "namespaces" else []
        self.log = None if self.limits.get("debug") else open(self.tmp / "zygote.log", "w+b")  # noqa: SIM115
        self.process = subprocess.Popen([*cmd, str(theirs.fileno()), json.dumps(_site_dirs()), *preload],
                                        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=self.log,
                                        start_new_session=True)  # a Ctrl-C of the grader's is the grader's
        theirs.close()
        self.control = ours

    def build(self, stems: dict[str, list[str]]) -> None:
        """Write the course copies of these notebook stems (their exercises' names given); the
        namespaces zygote then preloads the part they share."""
        build_course(self.course, stems)
        if self.isolation.kind == "namespaces":
            self.control.send(b"built")  # the zygote preloads the shared part (root/active) now

    def wait_ready(self) -> None:
        """Until the zygote says it is ready (READY_TIMEOUT_S at most); if it is not, close it and
        raise OSError with its reason (its message, or the end of its stderr)."""
        self.control.settimeout(READY_TIMEOUT_S)
        try:
            hello = json.loads(self.control.recv(1 << 16) or b"{}")
        except (OSError, ValueError) as e:
            hello = {"ready": False, "error": str(e)}
        self.control.settimeout(None)
        if not hello.get("ready"):
            err = hello.get("error") or ""
            if not err and self.log is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=5)
                self.log.seek(0)
                err = self.log.read()[-2000:].decode(errors="replace")
            self.close()
            raise OSError(f"the grader's sandbox ({self.isolation.kind}) did not start: {err.strip() or 'no reason given'}")

    def spawn(self, stem: str, threads: int, grader_fd: int, judge_fd: int, lifeline_fd: int, **limits) -> None:
        """Start ``stem``'s notebook process; it talks on ``grader_fd`` and ``judge_fd`` (the notebook's
        ends, given away) and lives as long as the lifeline's write end stays open."""
        self.count += 1
        req = {"mode": self.isolation.kind, "stem": stem, "threads": threads, "course_root": self.course_root,
               "keep": _keep(), **self.limits, **limits}
        if self.isolation.kind != "namespaces":
            req["private_dir"] = str(self.private / f"nb{self.count}")
        if self.isolation.kind == "user":
            req["uid"] = UID_BASE + 65536 * (os.getpid() % 4096) + self.count % 65536  # two graders: two ranges
        socket.send_fds(self.control, [json.dumps(req).encode()], [grader_fd, judge_fd, lifeline_fd])

    def close(self) -> None:
        """End the zygote (bubblewrap ends everything in its sandbox) and remove its folder."""
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.process is not None:
            if self.isolation.kind != "namespaces":  # let each notebook's watcher end its notebook first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=2)
            self.process.kill()  # (bwrap ends everything in its sandbox)
            self.process.wait()
            self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None
        shutil.rmtree(self.tmp, ignore_errors=True)
