"""Helpers for the course "Attention, from the math to a Triton kernel".

Import what you need from the submodules::

    from helpers.runtime import setup          # device, seeds, Triton interpreter
    from helpers import reference, checks      # reference solutions and exercise checks

Importing the package imports neither torch nor Triton. It only makes sure that, whatever
imports Triton later in this process (a helper, a check, the learner's own ``import triton``),
two things happen around that import (:class:`_TritonSetup`):

1. Before it, :func:`helpers.runtime.configure_triton` switches Triton's interpreter on when there
   is no CUDA GPU. Triton reads ``TRITON_INTERPRET`` whenever a function is decorated with
   ``@triton.jit``, and it decorates its own library (``tl.zeros``, ``tl.max``, ...) while
   ``triton`` is imported: imported first with the variable unset, those stay compiled-only, and
   every kernel then fails in the interpreter with "Cannot call @triton.jit'd outside of the scope
   of a kernel".
2. After Triton's interpreter is loaded, and only for Triton < 3.7 with NumPy >= 2.4, the fix that
   Triton 3.7 made to it (:func:`_fix_interpreter_index`).
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import sys
import warnings

__version__ = "0.1.0"


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


class _PatchAfterLoading:
    """A module loader that runs the real one, then :func:`_fix_interpreter_index`."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        if name == "loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _fix_interpreter_index(module)


class _TritonSetup:
    """An import hook (``sys.meta_path``) that acts on two imports and imports nothing itself:
    ``triton`` (run :func:`helpers.runtime.configure_triton` first) and
    ``triton.runtime.interpreter`` (fixed after loading, where :func:`_interpreter_index_is_broken`)."""

    busy = False  # configure_triton imports torch, which may look for Triton in turn

    def find_spec(self, name, path=None, target=None):
        if name == "triton" and not self.busy:
            self.busy = True
            try:
                from .runtime import configure_triton

                configure_triton()
            finally:
                self.busy = False
        elif name == "triton.runtime.interpreter" and _interpreter_index_is_broken():
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchAfterLoading(spec.loader)
                return spec
        return None  # Python's usual finders import it


if not any(type(finder).__name__ == "_TritonSetup" for finder in sys.meta_path):
    sys.meta_path.insert(0, _TritonSetup())

if "triton.runtime.interpreter" in sys.modules and _interpreter_index_is_broken():
    _fix_interpreter_index(sys.modules["triton.runtime.interpreter"])

if "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ and "torch" in sys.modules:
    if not sys.modules["torch"].cuda.is_available():
        warnings.warn(
            "Triton was imported before the course's helpers, on a machine without a CUDA GPU: its "
            "interpreter is off, and Triton kernels will fail. Restart the kernel (or Python) and "
            "import helpers (or run setup()) before importing triton.",
            stacklevel=2,
        )
