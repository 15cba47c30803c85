"""A faster Triton 3.6 interpreter for the CPU tests, giving the same bits: a kernel launch patches
`triton.language` once, not again at every call of a `@triton.jit` helper inside it, and runs on a thread of its own.

Patching once. The interpreter (`triton/runtime/interpreter.py`) swaps every builtin of `tl`, `tl.core`, `tl.math`
and `tl.tensor` for its NumPy version (found with `inspect.getmembers`) when a kernel starts, and does it again at
every call of a jit function from the kernel (`tl.sum`'s combine function, `tl.max`, fusedkern's own helpers): about
1 ms a call, 40% of a row kernel's time at the tests' shapes. The repeat changes nothing: the builtins it looks for
were already swapped by the launch (a swapped one is no longer a builtin, so it is skipped), and the other attributes
it sets (`range`, `reduce`, tensor properties) get closures equal to the ones in place. The launch's own patch, and
its undoing when the kernel returns, are Triton's. A helper that sees a language module the kernel does not
(`tl.core` from Triton's `standard.py`) is still patched by Triton on its first call in a launch.

A thread of its own. CPython keeps a thread's frames in 16 KiB chunks, mapped when a call needs a new chunk and
unmapped when it returns out of it. A kernel launched from deep in a training step (Trainer, model, fusedkern, the
interpreter) whose per-operation calls straddle a chunk boundary maps and unmaps one on nearly every operation: a
million mmap/munmap pairs and their page faults in the Liger tests, a third of their time in the kernel. One
long-lived thread per process runs every launch from the bottom of its own stack, the caller waiting. A launch only
moves tensor storages and runs NumPy, so the torch state that is per thread (grad mode, autocast, dispatch modes)
does not enter it; an exception reaches the caller unchanged.

`tests/test_interpreter_patch.py` checks that kernels give bitwise the same outputs with and without this. Installed
by `tests/conftest.py` when the kernels run in the interpreter under Triton 3.6.x (the release whose interpreter this
follows); with another Triton the tests run on Triton's interpreter unchanged."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import os
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.runtime import interpreter

_REAL_PATCH_LANG = interpreter._patch_lang
_REAL_LAUNCH = interpreter.GridExecutor.__call__
#: one entry per kernel launch in progress: the ids of the language modules its patches cover
_covered: list[set[int]] = []


class _NothingToRestore:
    def restore(self) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _language_modules(fn) -> frozenset[int]:
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def _patch_lang(fn):
    langs = _language_modules(fn)
    if _covered and langs and langs <= _covered[-1]:
        return _NothingToRestore()
    scope = _REAL_PATCH_LANG(fn)
    if _covered:
        _covered[-1].update(langs)
    return scope


def _launch_here(self, args, kwargs):
    _covered.append(set())
    try:
        return _REAL_LAUNCH(self, *args, **kwargs)
    finally:
        _covered.pop()


_launcher: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (process id, its launch thread)


def _launch(self, *args, **kwargs):
    global _launcher
    if _launcher is None or _launcher[0] != os.getpid():  # a forked child has no copy of its parent's thread
        _launcher = os.getpid(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="triton-interpreter")
    return _launcher[1].submit(_launch_here, self, args, kwargs).result()


def supported() -> bool:
    return triton.__version__.startswith("3.6.")


def install() -> None:
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = _launch


def installed() -> bool:
    return interpreter._patch_lang is _patch_lang and interpreter.GridExecutor.__call__ is _launch


@contextlib.contextmanager
def triton_as_released():
    """Triton's own interpreter inside the block (to compare against)."""
    was = installed()
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = _REAL_PATCH_LANG, _REAL_LAUNCH
    try:
        yield
    finally:
        if was:
            install()


_ROOT = str(Path(__file__).resolve().parents[1])
#: installs this patch in a fresh process, leaving no name behind (a notebook's namespace stays its own) and sys.path
#: as it was
_INSTALL = f"""
def _install_the_tests_interpreter_patch():
    import sys
    sys.path.insert(0, {_ROOT!r})
    try:
        import fusedkern
        from fusedkern._runtime import interpreting
        from tests import _interpreter
        if interpreting() and _interpreter.supported():
            _interpreter.install()
    finally:
        sys.path.remove({_ROOT!r})
_install_the_tests_interpreter_patch()
del _install_the_tests_interpreter_patch
"""
#: `python -c` program: runs the script `sys.argv[1]` as `python SCRIPT ARGS` would, with this patch installed
_RUN_SCRIPT = _INSTALL + """
import runpy, sys
sys.argv = sys.argv[1:]
sys.path[0] = __import__("os").path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def script_command(script, *args) -> list[str]:
    """The command line of `python SCRIPT ARGS` in a fresh process on this patch: the script's kernels run as fast
    as the tests' own."""
    return [sys.executable, "-c", _RUN_SCRIPT, str(script), *map(str, args)]


def notebook_env(folder, env=None) -> dict:
    """The environment (os.environ or `env`, plus IPYTHONDIR) under which run_all.py's notebook kernels start on this
    patch: an IPython folder under `folder` whose startup file installs it (IPython runs startup files silently,
    before the first cell)."""
    startup = Path(folder) / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-fusedkern-tests-interpreter.py").write_text(_INSTALL)
    return dict(os.environ if env is None else env, IPYTHONDIR=str(Path(folder) / "ipython"))
