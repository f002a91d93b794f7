"""The memory allocator ``coalesce serve`` runs on (``--allocator``), settled before anything else starts.

Why: glibc's malloc gives threads arenas of their own and keeps what tensors of ever-changing shapes
leave behind in fragments it does not hand back, so a long-lived replica's resident memory creeps up
under varying load (issue 24: +80% in three minutes of alternating load, still rising), and a container
sized from its first minutes is OOM-killed days later. jemalloc purges unused pages on a background
thread and stays level (PyTorch's CPU serving guides recommend it, or tcmalloc, for the same reason).

``--allocator auto`` (the default), first thing in ``coalesce serve``, before torch is imported and
before any thread starts:

1. already on jemalloc or tcmalloc (the images preload jemalloc; or the caller's ``LD_PRELOAD``): kept;
2. on glibc, with jemalloc installed (Debian and Ubuntu's ``libjemalloc2``): the process re-executes
   itself once, same interpreter, arguments and environment, plus jemalloc in ``LD_PRELOAD`` and
   :data:`JEMALLOC_CONF` in ``MALLOC_CONF`` (unless one is set). Its pid stays; ``--workers`` children
   inherit the environment, so every process of the replica runs on it. Where the command line makes
   this plain, ``coalesce serve`` takes this step before it imports its settings (``reexec.early``);
   :func:`prepare` takes it otherwise;
3. on glibc without jemalloc: at most :data:`ARENA_MAX` arenas (``mallopt``, before any thread exists),
   and the engine returns freed memory to the system after batches (``malloc_trim``: see
   :class:`Trimmer`).

On jemalloc with our options, the engine (the process that runs the forwards) turns the dirty-page decay
off and purges every arena itself after batches instead (:class:`Jemalloc` says why).

``jemalloc`` does the same but exits, naming the package, where jemalloc cannot be loaded; ``glibc``
skips the re-exec and tunes glibc; ``system`` leaves malloc as the process started. Every process logs
what it runs on once, at start-up (the ``allocator`` line).

The allocator is not the only thing that grows with shapes. oneDNN, which runs the CPU forward's linear
layers and matrix products, compiles a kernel for every operation *and shape* and keeps it in two
caches, its own primitive cache and PyTorch's (ideep's) computation cache, 1,024 entries each by
default; with the packed CPU forward an entry holds buffers of its own too, so under varying batch
shapes a replica grows by hundreds of MiB, and goes on creeping for as long as new shapes come.
:func:`bound_kernel_caches` (``--cpu-kernel-cache``) caps both before the first kernel is built; the
default of 64 entries keeps that growth to tens of MiB (BENCHMARKS.md's memory section measures it
beside the libraries' defaults, throughput included).

This module and ``reexec.py`` read and write ``os.environ``, the exceptions to "only Settings reads the
environment": oneDNN and ideep read their caches' capacities from the environment once, when their
first kernel is built (PyTorch has no call that sets them); ``LD_PRELOAD`` and ``MALLOC_CONF`` are read
by the dynamic loader and by jemalloc as a process image starts, before any Python runs, so they take
effect only through the environment of an ``exec``; the marker that keeps the re-exec to one must
survive that ``exec``, which only the environment does; and ``reexec.early`` reads
``COALESCE_ALLOCATOR`` before the Settings exist, as they read it (a unit test holds the two to one name
and default).
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The re-exec itself, and what it needs to know, live in a module light enough to run before the settings
# are imported (reexec.early); re-exported here, where the rest of the server has always found them.
from .reexec import (
    JEMALLOC_CONF,
    JEMALLOC_SONAME,
    REEXEC_MARKER,
    find_jemalloc,
    library_dirs,
    mapped,
    reexec_command,
)
from .reexec import reexec as _reexec

__all__ = [
    "ARENA_MAX",
    "JEMALLOC_CONF",
    "JEMALLOC_PACKAGE",
    "JEMALLOC_SONAME",
    "KERNEL_CACHE_VARIABLES",
    "REEXEC_MARKER",
    "TRIM_EVERY_S",
    "Allocator",
    "Jemalloc",
    "Trimmer",
    "bound_kernel_caches",
    "find_jemalloc",
    "libc_is_glibc",
    "library_dirs",
    "mapped",
    "prepare",
    "reexec_command",
]

JEMALLOC_PACKAGE = "libjemalloc2"
ARENA_MAX = 2  # glibc's arenas when jemalloc is missing (its default is 8 per core)
# malloc_trim (glibc) or a purge (jemalloc) at most this often while batches run, and once after the last
TRIM_EVERY_S = 10.0
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
# oneDNN's primitive cache and PyTorch's ideep computation cache: the entries each keeps (default 1,024).
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@dataclass(frozen=True, slots=True)
class Allocator:
    """What this process allocates with, and how it came to.

    ``name``: jemalloc, tcmalloc, glibc or other (another libc). ``how``: preloaded (before we started:
    an image's or a caller's ``LD_PRELOAD``), re-exec (by this module), tuned (glibc with bounded arenas
    and trimming) or untouched. ``library``: the allocator's shared object, when not the libc's."""

    name: str
    how: str
    library: str | None = None
    note: str = ""

    def fields(self) -> dict[str, Any]:
        """The start-up log line's fields."""
        out: dict[str, Any] = {"allocator": self.name, "how": self.how}
        if self.library:
            out["library"] = self.library
        if self.name == "jemalloc":
            out["malloc_conf"] = os.environ.get("MALLOC_CONF", "")
        if self.how == "tuned":
            out.update(arena_max=ARENA_MAX, trim_every_s=TRIM_EVERY_S)
        if self.note:
            out["note"] = self.note
        return out


def _self_maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing is known to be preloaded
        return ""


def _libc() -> Any:
    return ctypes.CDLL(None)


def libc_is_glibc() -> bool:
    """Whether this process's C library is glibc (musl and others lack ``gnu_get_libc_version``)."""
    try:
        return hasattr(_libc(), "gnu_get_libc_version")
    except OSError:
        return False


def _bound_arenas() -> None:
    """At most :data:`ARENA_MAX` glibc arenas (threads share them; each holds its own free memory)."""
    _libc().mallopt(_M_ARENA_MAX, ARENA_MAX)


def prepare(mode: str, argv: Sequence[str]) -> Allocator:
    """Settle the allocator ``mode`` asks for, as described above; call it before torch is imported and
    before any thread starts. Re-executes the process (so never returns) when that is the plan; exits
    with a message when ``mode`` is ``jemalloc`` and jemalloc cannot be had."""
    found = mapped(_self_maps())
    reexecuted = REEXEC_MARKER in os.environ
    if found is not None:
        return Allocator(found[0], "re-exec" if reexecuted else "preloaded", found[1])
    glibc = libc_is_glibc()
    if mode == "system":
        return Allocator("glibc" if glibc else "other", "untouched")
    note = "--allocator glibc"
    if mode in ("auto", "jemalloc"):
        if reexecuted:
            note = f"preloading {os.environ[REEXEC_MARKER]} failed (see the loader's message above)"
        elif (library := find_jemalloc()) is None:
            note = f"jemalloc not installed ({JEMALLOC_SONAME}: Debian/Ubuntu package {JEMALLOC_PACKAGE})"
        else:
            note = f"re-exec on {library} failed: {_reexec(library, argv)}"
    if mode == "jemalloc":
        raise SystemExit(f"--allocator jemalloc: {note}")
    if not glibc:
        return Allocator("other", "untouched", note=note)
    _bound_arenas()
    return Allocator("glibc", "tuned", note=note)


def bound_kernel_caches(entries: int) -> dict[str, str]:
    """Cap oneDNN's compiled-kernel caches at ``entries`` each (0: leave the libraries' default), by the
    variables they read once, at their first kernel: so call it before the model's first forward. A
    variable already in the environment is the operator's and is kept. Returns the capacities in effect
    that this process set or found (for the ``allocator`` log line)."""
    if entries > 0:
        for name in KERNEL_CACHE_VARIABLES:
            os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES if name in os.environ}


def freeze_startup_heap() -> dict[str, float]:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``), so its
    full collections stop walking them; call it once, when the process is ready to serve. Returns how
    many objects were frozen and the milliseconds it took (one collection first), for the log line.

    Why: after start-up a serving process holds long-lived objects by the hundred thousand (torch,
    transformers, tokenizers, the app: about 190,000 with the packaged model, says the ``heap_frozen``
    line) that a full ("generation 2") collection walks every time, and requests create enough cyclic
    garbage (futures, exceptions) that one comes every few seconds under load. Each stops the event
    loop, and the forward's thread at its next operation, for about as long as the collection here
    takes at start-up (its ``ms``): a stall every few seconds that the p99 of admitted requests shows.
    Frozen objects are never collected; what start-up left as garbage is collected first. The remedy
    CPython documents with ``gc.freeze`` (for servers that fork; Instagram's for the same pauses)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return {"objects": gc.get_freeze_count(), "ms": round((time.perf_counter() - t0) * 1e3, 1)}


MALLCTL_ARENAS_ALL = 4096  # jemalloc's index for "every arena" in mallctl names (MALLCTL_ARENAS_ALL)


class Jemalloc:
    """The two controls of jemalloc (``mallctl``) the engine uses, where the process runs on it.

    Why: our :data:`JEMALLOC_CONF` purges pages unused for a second (``dirty_decay_ms:1000``), and jemalloc
    purges along a decay curve, a share of the freed pages at every step. The forward frees its
    activations (tens of MiB for a batch of long inputs) at the end of every batch and allocates them again
    at the next, so the decay hands those pages back between batches and the next forward faults them in
    and the kernel zeroes them again (longer decays purge as much; only none stops it): on this project's
    2-core CPU a batch of 64 chunks of 20 to 60 words took hundreds of times the page faults and fifty
    times the system time, and ran a tenth to a seventh slower (``python -m
    coalesce.loadtests.alloc_forward``, in BENCHMARKS.md). :meth:`keep_freed_pages` turns the decay off
    in the process that runs the forwards, and :class:`Trimmer` purges every arena (:meth:`purge`) every
    :data:`TRIM_EVERY_S` while batches run and once after the last: what a varying load leaves behind
    still goes back, at most that long later, and an idle server holds no more than before. The
    gateways of ``--workers`` keep the decay (they run no forward)."""

    def __init__(self, library: str) -> None:
        self._mallctl = ctypes.CDLL(library).mallctl
        self._mallctl.restype = ctypes.c_int
        self._mallctl.argtypes = [
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]

    def _set_decay(self, name: str, ms: int) -> int:
        value = ctypes.c_ssize_t(ms)
        return int(self._mallctl(name.encode(), None, None, ctypes.byref(value), ctypes.sizeof(value)))

    def decay_ms(self, arena: int | None = None) -> int:
        """The dirty-page decay of ``arena`` (None: the default of arenas created from now on)."""
        name = "arenas.dirty_decay_ms" if arena is None else f"arena.{arena}.dirty_decay_ms"
        value, size = ctypes.c_ssize_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
        if self._mallctl(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            raise OSError(f"mallctl {name} failed")
        return value.value

    def arenas(self) -> int:
        """How many arena indices exist (some may not be initialised yet)."""
        value, size = ctypes.c_uint(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
        if self._mallctl(b"arenas.narenas", ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return 0
        return value.value

    def keep_freed_pages(self) -> bool:
        """No dirty-page decay, for arenas created from now on and for those that exist (an index not
        initialised yet refuses, and takes the new default when it is). False where the default cannot
        be set (another jemalloc build)."""
        if self._set_decay("arenas.dirty_decay_ms", -1) != 0:
            return False
        for arena in range(self.arenas()):
            self._set_decay(f"arena.{arena}.dirty_decay_ms", -1)
        return True

    def purge(self) -> bool:
        """Hand every arena's unused pages back to the system now."""
        return self._mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0


def _jemalloc(library: str) -> Jemalloc:
    return Jemalloc(library)


class Trimmer:
    """Returns the memory the allocator holds freed to the system after batches (glibc's ``malloc_trim``,
    or a purge of jemalloc's arenas: see :class:`Jemalloc`).

    :meth:`batch_done` (any thread, after each batch; it only sets an event) wakes a thread of its own,
    which waits ``every_s``, then trims, so trims come at most every ``every_s`` while batches run and
    once more ``every_s`` after the last one; then the thread sleeps until the next batch: an idle server
    does nothing. A trim takes each arena's lock in turn while it walks that arena, so an allocation
    meanwhile waits for it (a few milliseconds for a heap of hundreds of MiB)."""

    def __init__(
        self, trim: Callable[[], object], every_s: float = TRIM_EVERY_S, name: str = "malloc_trim"
    ) -> None:
        self._trim = trim
        self._name = name  # its debug log line's event
        self._every = every_s
        self._work = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coalesce-trim", daemon=True)
        self.trims = 0
        self.last_s = 0.0  # how long the last trim took

    @classmethod
    def for_process(cls, mode: str) -> Trimmer | None:
        """A started trimmer for the process that runs the forwards (the engine), or None:

        - glibc tuned by :func:`prepare` (``mode`` auto or glibc, nothing preloaded): ``malloc_trim``;
        - jemalloc with our :data:`JEMALLOC_CONF` (``mode`` not system, ``MALLOC_CONF`` ours or unset):
          :meth:`Jemalloc.keep_freed_pages` first, then the trimmer purges every arena;
        - anything else (``--allocator system``, tcmalloc, an operator's own ``MALLOC_CONF``): None."""
        if mode == "system":
            return None
        found = mapped(_self_maps())
        if found is None:
            if not libc_is_glibc():
                return None
            trimmer = cls(lambda: _libc().malloc_trim(0))
        elif found[0] == "jemalloc" and os.environ.get("MALLOC_CONF", JEMALLOC_CONF) == JEMALLOC_CONF:
            jemalloc = _jemalloc(found[1])
            if not jemalloc.keep_freed_pages():
                return None  # a jemalloc without these controls: it keeps its own decay
            trimmer = cls(jemalloc.purge, name="jemalloc_purge")
        else:
            return None
        from .logs import get_logger  # here, not at import: the re-exec step must stay light

        get_logger("coalesce.allocator").info(
            "memory_return", how=trimmer._name, every_s=trimmer._every,
            kept_between_batches=found is not None,
        )
        trimmer.start()
        return trimmer

    def start(self) -> None:
        self._thread.start()

    def batch_done(self) -> None:
        """A batch finished (any thread). The event is set only when it is clear: ``Event.set`` takes a
        lock and notifies each time, and from a run's first batch until its trim starts the event stays
        set (the thread clears it just before trimming, so that trim follows every batch that found it
        set)."""
        if not self._work.is_set():
            self._work.set()

    def _run(self) -> None:
        # The trimmer thread only: the events are its sole shared state.
        from .logs import get_logger  # here, not at import: the re-exec step must stay light

        log = get_logger("coalesce.allocator")
        while True:
            self._work.wait()
            if self._stop.wait(self._every):
                return
            self._work.clear()
            t0 = time.perf_counter()
            released = self._trim()
            self.last_s = time.perf_counter() - t0
            self.trims += 1
            log.debug(self._name, seconds=round(self.last_s, 4), released=bool(released))

    def close(self) -> None:
        self._stop.set()
        self._work.set()
        if self._thread.is_alive():
            self._thread.join(5)
