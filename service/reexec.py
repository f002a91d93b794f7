"""The jemalloc re-exec of ``coalesce serve`` (``service/allocator.py`` says why and when), in a module that
imports nothing but ``os`` and ``sys``, so that :func:`early` can take it before the server imports even
its settings: the process it replaces would otherwise import and parse them (and the allocator module)
only to be replaced, and every start on a glibc host paid that twice.

:func:`early` re-executes only where the command line and the environment make it plain that
``allocator.prepare`` would: ``--allocator`` (or ``COALESCE_ALLOCATOR``) auto or jemalloc, unabbreviated;
nothing preloaded yet; glibc; jemalloc installed. Everywhere else it returns, and ``prepare`` decides after
the settings are read, as it always has, and says what it did.

Like ``allocator.py``, this module reads and writes ``os.environ``: ``LD_PRELOAD`` and ``MALLOC_CONF``
take effect only through the environment of an ``exec``, and the marker that keeps the re-exec to one must
survive it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence

# Set in the re-executed process's environment (to the library preloaded), so it never re-executes again;
# inherited by the --workers children. Not a COALESCE_* knob: nobody sets it by hand.
REEXEC_MARKER = "_COALESCE_ALLOCATOR_REEXEC"
JEMALLOC_SONAME = "libjemalloc.so.2"
# jemalloc's options for a server, the images' MALLOC_CONF too: purge unused pages on a background thread
# (an idle server still gives memory back), after a second unused (a burst's excess goes within seconds,
# while batch after batch reuses the same pages), straight to the system (muzzy pages, MADV_FREE, would
# still count as resident until the kernel wants them), over at most 4 arenas (bounded per-arena slack;
# the default is 4 per core).
JEMALLOC_CONF = "background_thread:true,narenas:4,dirty_decay_ms:1000,muzzy_decay_ms:0"
# The --allocator knob as the settings declare it (a unit test holds them to it): its flag, its variable,
# and the modes that re-execute.
ALLOCATOR_FLAG = "--allocator"
ALLOCATOR_ENV = "COALESCE_ALLOCATOR"
ALLOCATOR_DEFAULT = "auto"
REEXEC_MODES = ("auto", "jemalloc")


def mapped(maps: str) -> tuple[str, str] | None:
    """``(name, path)`` of a jemalloc or tcmalloc mapped into a process, from its ``/proc/PID/maps``."""
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        base = os.path.basename(parts[5])
        for name in ("jemalloc", "tcmalloc"):
            if base.startswith("lib" + name):
                return name, parts[5]
    return None


def self_maps() -> str:
    """This process's ``/proc/self/maps``; empty where there is none (not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def library_dirs() -> list[str]:
    """Where distributions put shared libraries: Debian's multiarch directories, then the usual others."""
    triplet = f"{os.uname().machine}-linux-gnu"
    return [f"/usr/lib/{triplet}", f"/lib/{triplet}", "/usr/lib64", "/usr/lib", "/usr/local/lib"]


def find_jemalloc(dirs: Iterable[str] | None = None) -> str | None:
    """The path of ``libjemalloc.so.2`` in ``dirs`` (default :func:`library_dirs`), or None. Looked up
    by file, not through ``ctypes.util.find_library``, which runs ldconfig and a compiler."""
    for d in library_dirs() if dirs is None else dirs:
        path = os.path.join(d, JEMALLOC_SONAME)
        if os.path.isfile(path):
            return path
    return None


def reexec_command(argv: Sequence[str]) -> list[str]:
    """The command that starts this ``coalesce serve ARGV`` again: the interpreter's own command line when
    it is the one that ran (``coalesce serve``, ``python -m coalesce.service.cli serve``), else the module
    form with ``argv`` (``main()`` called with arguments of its own)."""
    if sys.argv[1:] == ["serve", *argv] and len(sys.orig_argv) > 1:
        return [sys.executable, *sys.orig_argv[1:]]
    return [sys.executable, "-m", "coalesce.service.cli", "serve", *argv]


def reexec(library: str, argv: Sequence[str]) -> OSError:
    """Replace this process with itself on ``library``; returns only if ``exec`` failed."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[REEXEC_MARKER] = library
    command = reexec_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], command, env)
    except OSError as exc:
        return exc
    raise AssertionError("unreachable: execve returned")  # pragma: no cover


def glibc() -> bool:
    """Whether this process's C library is glibc, told without ctypes (only glibc answers this)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError, AttributeError):
        return False


def asked_mode(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The allocator mode ``argv`` and ``environ`` ask for, as the settings would read it (the flag's
    last value over the variable over the default), or None where that is not plain without the settings'
    parser: an abbreviated flag (``--alloc``), a flag with no value."""
    mode = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == ALLOCATOR_FLAG:
            if eq:
                mode = value
            elif i + 1 < len(argv):
                mode = argv[i + 1]
            else:
                return None
        elif len(name) > 2 and name.startswith("--") and ALLOCATOR_FLAG.startswith(name):
            return None  # argparse would take a unique prefix for the flag
    return mode if mode is not None else environ.get(ALLOCATOR_ENV, ALLOCATOR_DEFAULT)


def early(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """Re-execute on jemalloc now, where ``allocator.prepare`` plainly would (see above); else return.
    Returns too if the exec fails (``prepare`` tries again, and says why)."""
    env = os.environ if environ is None else environ
    if REEXEC_MARKER in env or asked_mode(argv, env) not in REEXEC_MODES:
        return
    if mapped(self_maps()) is not None or not glibc():
        return
    library = find_jemalloc()
    if library is not None:
        reexec(library, argv)
