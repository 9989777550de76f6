"""Runtime set-up: device, seeds, Colab detection, and what must happen before Triton loads.

Every notebook calls :func:`setup` once, after its Colab bootstrap cell. Importing ``helpers``
calls :func:`install_import_hook`, the one piece of import-time machinery in the package: an
import hook (``sys.meta_path``) that acts on three kinds of import and imports nothing itself.

1. ``triton``: :func:`configure_triton` runs first. Triton reads ``TRITON_INTERPRET`` whenever a
   function is decorated with ``@triton.jit``, its own library included (``tl.zeros``, ``tl.max``,
   ... are decorated while ``triton`` is imported): imported first with the variable unset, those
   stay compiled-only and every kernel then fails in the interpreter with "Cannot call
   @triton.jit'd outside of the scope of a kernel". The hook makes the order in a notebook
   irrelevant, as long as ``helpers`` is imported before ``triton``.
2. ``triton.runtime.interpreter``, only for Triton < 3.7 with NumPy >= 2.4 (e.g. torch 2.11's
   Triton 3.6): after loading, the fix Triton 3.7 made to it (:func:`_fix_interpreter_index`).
3. A module the course has renamed (``helpers.attention`` is now ``helpers.nb01_qkv_shapes``,
   :data:`MOVED`): the new module, under its old name too, so that a learner's notebook written
   against an earlier release still imports.

This module imports only the standard library at import time (torch and NumPy inside the
functions), so that importing ``helpers`` cannot import Triton before the hook is in place.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import random
import re
import sys
import warnings

MOVED = {
    "helpers.attention": "helpers.nb01_qkv_shapes",
    "helpers.scaling": "helpers.nb02_scaling",
    "helpers.masks": "helpers.nb03_masks",
    "helpers.backward": "helpers.nb04_backward",
    "helpers.multihead": "helpers.nb05_multihead",
    "helpers.kv_sharing": "helpers.nb06_kv_sharing",
    "helpers.kv_cache": "helpers.nb07_kv_cache",
    "helpers.flops": "helpers.nb08_flops_memory",
    "helpers.flash": "helpers.nb09_flash_attention",
    "helpers.triton_flash": "helpers.nb09_triton_flash",
    "helpers.positions": "helpers.nb10_positions",
    "helpers.model": "helpers.nb11_trained_transformer",
    "helpers.grading": "helpers.tools.grading",
    "helpers.notebooks": "helpers.tools.notebooks",
}
"""Module names of release 0.1 -> where the module lives now (see CHANGELOG.md)."""


# --------------------------------------------------------------------------- device, seeds, machine


def in_colab() -> bool:
    """True inside Google Colab (its kernel imports `google.colab` at start-up)."""
    return "google.colab" in sys.modules


def has_cuda() -> bool:
    """True when a CUDA GPU is usable by torch."""
    import torch

    return torch.cuda.is_available()


def configure_triton() -> bool:
    """Turn on Triton's CPU interpreter when there is no CUDA GPU; return True if it is on.

    Must run before `triton` is first imported (module docstring, point 1): the import hook calls
    it just before that, and `setup()` calls it too. An explicit TRITON_INTERPRET set by the user
    is respected.
    """
    if not has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def seed_everything(seed: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators (CPU and CUDA)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(seed: int = 0, quiet: bool = False):
    """Pick the device, seed everything and configure Triton; return the ``torch.device``.

    Prints one line, e.g. ``Runtime: cpu, Triton interpreter on, seed 0``. Printing options are
    fixed (4 decimals, no scientific notation) so that notebook outputs are stable.
    """
    import numpy as np
    import torch

    # A CUDA build of torch on a machine with a CUDA toolkit but no GPU (Colab's CPU runtime, pip's
    # default torch on Linux) logs "No CUDA runtime is found, using CUDA_HOME=..." to stderr when
    # torch.utils.benchmark is imported; the course compiles no C++ extension, so it says nothing.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    interpreter = configure_triton()
    seed_everything(seed)
    torch.set_printoptions(precision=4, sci_mode=False, linewidth=100)
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    device = torch.device("cuda" if has_cuda() else "cpu")
    if not quiet:
        where = f"cuda ({torch.cuda.get_device_name()})" if device.type == "cuda" else "cpu"
        triton = "Triton interpreter on" if interpreter else "Triton compiled"
        colab = ", Colab" if in_colab() else ""
        print(f"Runtime: {where}{colab}, {triton}, seed {seed}")
    return device


def machine_name() -> str:
    """Where a measurement was taken, e.g. ``AMD EPYC, 2 cores, Linux-6.1-x86_64, torch 2.13.0+cpu``
    (the GPU's name first when CUDA is in use). Notebooks print it next to every timing."""
    import platform

    import torch

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    gpu = f"{torch.cuda.get_device_name()}, " if has_cuda() else ""
    return f"{gpu}{cpu}, {os.cpu_count()} cores, {platform.platform(terse=True)}, torch {torch.__version__}"


# --------------------------------------------------------------------------- Triton < 3.7 with NumPy >= 2.4


def _version(text: str) -> tuple[int, int]:
    """'3.6.0+git1234' -> (3, 6)."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _interpreter_index_is_broken() -> bool:
    """True for Triton < 3.7 with NumPy >= 2.4 (triton-lang/triton#9171, fixed by #9172 in 3.7).

    In the interpreter every scalar, loop bounds included, is a NumPy array of shape (1,), and
    Triton < 3.7 turns it into a Python int with ``int(array)``, which NumPy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"). Any kernel whose ``range(...)``
    has a bound known only at run time (the sequence length: every FlashAttention kernel, the
    course's and the learner's) stops at that loop."""
    import numpy

    triton = sys.modules.get("triton")
    if triton is None:
        return False
    return _version(numpy.__version__) >= (2, 4) and _version(getattr(triton, "__version__", "")) < (3, 7)


def _fix_interpreter_index(interpreter) -> None:
    """Give the interpreter's ``tl.tensor.__index__`` the body Triton 3.7 gave it,
    ``int(self.handle.data.squeeze())``, by wrapping ``_patch_lang_tensor``, which installs it at
    each kernel launch (``_patch_lang_tensor(tensor, scope)``; older versions take ``(tensor)`` or
    ``(tensor, builder)`` and set it directly). Nothing else changes."""
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "course_numpy24_fix", False):
        return

    def _patch_lang_tensor(tensor, *args, **kwargs):
        original(tensor, *args, **kwargs)
        index = lambda self: int(self.handle.data.squeeze())  # noqa: E731
        scope = args[0] if args and hasattr(args[0], "set_attr") else None
        if scope is not None:
            scope.set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    _patch_lang_tensor.course_numpy24_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


# --------------------------------------------------------------------------- the import hook


class _Loader:
    """Runs ``before(spec)`` or ``after(module)`` around the real loader, or hands out an already
    imported module (``alias``: a renamed course module)."""

    def __init__(self, loader=None, after=None, alias: str | None = None):
        self.loader, self.after, self.alias = loader, after, alias

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        if name == "loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def get_code(self, name):  # `python -m helpers.grading`: runpy runs the new module's code
        if self.alias is not None:
            return importlib.util.find_spec(self.alias).loader.get_code(self.alias)
        return self.loader.get_code(name)

    def create_module(self, spec):
        if self.alias is not None:
            module = importlib.import_module(self.alias)
            self.real_spec = module.__spec__  # the import system sets __spec__ to the alias's: put it back
            return module
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if self.alias is not None:
            module.__spec__ = self.real_spec
        else:
            self.loader.exec_module(module)
            self.after(module)


class _AliasSpec(importlib.machinery.ModuleSpec):
    """The spec of a renamed module under its old name; its package is the new module's, so that
    ``python -m helpers.grading`` runs ``helpers.tools.grading`` with the right relative imports."""

    @property
    def parent(self):
        return MOVED[self.name].rpartition(".")[0]


class _CourseImportHook:
    """The finder :func:`install_import_hook` puts first on ``sys.meta_path`` (module docstring)."""

    busy = False  # configure_triton imports torch, which may look for Triton in turn

    def find_spec(self, name, path=None, target=None):
        if name == "triton" and not self.busy:
            self.busy = True
            try:
                configure_triton()
            finally:
                self.busy = False
        elif name == "triton.runtime.interpreter" and _interpreter_index_is_broken():
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, after=_fix_interpreter_index)
                return spec
        elif name in MOVED:
            new = importlib.util.find_spec(MOVED[name])
            return _AliasSpec(name, _Loader(alias=MOVED[name]), origin=new.origin)
        return None  # Python's usual finders import it


def install_import_hook() -> None:
    """Install :class:`_CourseImportHook` once per process (importing ``helpers`` does), fix an
    interpreter loaded before it, and warn when Triton was imported first without a GPU."""
    if not any(type(finder).__name__ == "_CourseImportHook" for finder in sys.meta_path):
        sys.meta_path.insert(0, _CourseImportHook())
    if "triton.runtime.interpreter" in sys.modules and _interpreter_index_is_broken():
        _fix_interpreter_index(sys.modules["triton.runtime.interpreter"])
    if "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ and "torch" in sys.modules:
        if not sys.modules["torch"].cuda.is_available():
            warnings.warn(
                "Triton was imported before the course's helpers, on a machine without a CUDA GPU: its "
                "interpreter is off, and Triton kernels will fail. Restart the kernel (or Python) and "
                "import helpers (or run setup()) before importing triton.",
                stacklevel=3,
            )
