"""The allocator step of ``coalesce serve`` (service/allocator.py) with the process mocked: what is mapped,
which libc, whether jemalloc is installed, and ``execve`` itself. Plus the trimmer, the device thread's
hook, and each process's resident memory in /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from coalesce.kernels.worker import DeviceThread, ModelWorker
from coalesce.service import allocator, reexec, settings
from coalesce.service.allocator import REEXEC_MARKER, Allocator, Trimmer, mapped, prepare
from coalesce.service.metrics import Metrics, write_processes
from coalesce.service.settings import build

from ..fakes import FakeRunner

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
GLIBC_MAPS = """\
55d0c6a00000-55d0c6a2a000 r--p 00000000 fe:00 1234   /usr/bin/python3.11
7f1c2a000000-7f1c2a022000 r--p 00000000 fe:00 5678   /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2b000000-7f1c2b021000 rw-p 00000000 00:00 0
7ffd1a000000-7ffd1a021000 rw-p 00000000 00:00 0      [stack]
"""
JEMALLOC_MAPS = GLIBC_MAPS + f"7f1c2c000000-7f1c2c009000 r--p 00000000 fe:00 91011  {JEMALLOC}\n"


class Exec(BaseException):
    """Stands for a successful ``execve``: it never returns."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(path)
        self.path, self.argv, self.env = path, argv, env


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", (param, value)))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", (pad,)))
        return 1


@pytest.fixture
def process(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A glibc process with nothing preloaded and jemalloc installed; tweak the attributes per test."""

    class Process:
        maps = GLIBC_MAPS
        glibc = True
        jemalloc: str | None = JEMALLOC
        exec_error: OSError | None = None
        libc = FakeLibc()

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        if Process.exec_error is not None:
            raise Process.exec_error
        raise Exec(path, argv, env)

    monkeypatch.setattr(allocator, "_self_maps", lambda: Process.maps)
    monkeypatch.setattr(allocator, "libc_is_glibc", lambda: Process.glibc)
    monkeypatch.setattr(allocator, "find_jemalloc", lambda dirs=None: Process.jemalloc)
    monkeypatch.setattr(allocator, "_libc", lambda: Process.libc)
    monkeypatch.setattr(allocator.os, "execve", execve)
    monkeypatch.setattr(reexec, "self_maps", lambda: Process.maps)
    monkeypatch.setattr(reexec, "glibc", lambda: Process.glibc)
    monkeypatch.setattr(reexec, "find_jemalloc", lambda dirs=None: Process.jemalloc)
    for name in ("LD_PRELOAD", "MALLOC_CONF", REEXEC_MARKER):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/coalesce", "serve", "--port", "9000"])
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", *sys.argv])
    return Process


# -- detection ---------------------------------------------------------------------------------------
def test_the_allocator_is_read_from_the_libraries_a_process_maps() -> None:
    assert mapped(GLIBC_MAPS) is None
    assert mapped(JEMALLOC_MAPS) == ("jemalloc", JEMALLOC)
    tc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    assert mapped(GLIBC_MAPS + f"7f00-7f01 r-xp 00000000 fe:00 1 {tc}\n") == ("tcmalloc", tc)
    # A file that merely mentions jemalloc in a directory name is not the library.
    assert mapped(GLIBC_MAPS + "7f00-7f01 r--p 00000000 fe:00 1 /opt/jemalloc-docs/readme.so\n") is None


def test_jemalloc_is_found_by_its_file_in_the_library_directories(tmp_path: Path) -> None:
    empty, lib = tmp_path / "empty", tmp_path / "lib"
    empty.mkdir()
    lib.mkdir()
    assert allocator.find_jemalloc([str(empty)]) is None
    (lib / "libjemalloc.so.2").write_bytes(b"\x7fELF")
    assert allocator.find_jemalloc([str(empty), str(lib)]) == str(lib / "libjemalloc.so.2")
    assert any("linux-gnu" in d for d in allocator.library_dirs())


def test_the_flag_and_its_variable_choose_the_allocator() -> None:
    assert build([], environ={}).allocator == "auto"
    assert build([], environ={"COALESCE_ALLOCATOR": "system"}).allocator == "system"
    assert build(["--allocator", "glibc"], environ={"COALESCE_ALLOCATOR": "system"}).allocator == "glibc"
    with pytest.raises(SystemExit, match="allocator must be"):
        build(["--allocator", "mimalloc"], environ={})


# -- the re-exec -------------------------------------------------------------------------------------
def test_on_glibc_with_jemalloc_installed_the_server_reexecutes_itself_once_on_it(process: Any) -> None:
    with pytest.raises(Exec) as done:
        prepare("auto", ["--port", "9000"])
    e = done.value
    # The same interpreter, the same command line, the same environment plus the preload.
    assert e.path == sys.executable
    assert e.argv == [sys.executable, "/venv/bin/coalesce", "serve", "--port", "9000"]
    assert e.env["LD_PRELOAD"] == JEMALLOC
    assert e.env["MALLOC_CONF"] == allocator.JEMALLOC_CONF
    assert "background_thread:true" in e.env["MALLOC_CONF"] and "narenas:" in e.env["MALLOC_CONF"]
    assert e.env[REEXEC_MARKER] == JEMALLOC
    assert e.env["PATH"] == os.environ["PATH"]
    assert process.libc.calls == []  # glibc left alone: the new image will not use it


def test_the_reexec_keeps_a_callers_preload_and_jemalloc_options(
    process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtrace.so")
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    with pytest.raises(Exec) as done:
        prepare("jemalloc", ["--port", "9000"])
    assert done.value.env["LD_PRELOAD"] == f"{JEMALLOC}:/opt/libtrace.so"
    assert done.value.env["MALLOC_CONF"] == "narenas:1"


def test_main_called_with_its_own_arguments_reexecutes_the_module_with_them(process: Any) -> None:
    sys.argv[:] = ["/usr/bin/pytest", "-q"]
    with pytest.raises(Exec) as done:
        prepare("auto", ["--port", "9100", "--workers", "2"])
    assert done.value.argv == [sys.executable, "-m", "coalesce.service.cli", "serve", "--port", "9100",
                               "--workers", "2"]


def test_the_reexecuted_process_and_its_workers_do_not_reexecute_again(
    process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REEXEC_MARKER, JEMALLOC)
    process.maps = JEMALLOC_MAPS
    assert prepare("auto", []) == Allocator("jemalloc", "re-exec", JEMALLOC)
    # The loader could not preload it (it says why on stderr): glibc, tuned, and no loop.
    process.maps = GLIBC_MAPS
    got = prepare("auto", [])
    assert (got.name, got.how) == ("glibc", "tuned") and "preloading" in got.note
    with pytest.raises(SystemExit, match="preloading"):
        prepare("jemalloc", [])


def test_a_preloaded_allocator_is_kept_whatever_the_mode(process: Any) -> None:
    process.maps = JEMALLOC_MAPS
    for mode in ("auto", "jemalloc", "glibc", "system"):
        assert prepare(mode, []) == Allocator("jemalloc", "preloaded", JEMALLOC)
    assert process.libc.calls == []


# -- the opt-outs and the fallback -------------------------------------------------------------------
def test_system_turns_it_all_off(process: Any) -> None:
    assert prepare("system", []) == Allocator("glibc", "untouched")
    assert process.libc.calls == []


def test_glibc_skips_the_reexec_and_bounds_the_arenas(process: Any) -> None:
    got = prepare("glibc", [])
    assert (got.name, got.how) == ("glibc", "tuned")
    assert process.libc.calls == [("mallopt", (-8, allocator.ARENA_MAX))]  # M_ARENA_MAX
    assert got.fields()["arena_max"] == allocator.ARENA_MAX and "trim_every_s" in got.fields()


def test_without_jemalloc_auto_tunes_glibc_and_says_which_package_is_missing(process: Any) -> None:
    process.jemalloc = None
    got = prepare("auto", [])
    assert (got.name, got.how) == ("glibc", "tuned") and "libjemalloc2" in got.note
    assert process.libc.calls == [("mallopt", (-8, allocator.ARENA_MAX))]
    with pytest.raises(SystemExit, match="libjemalloc2"):
        prepare("jemalloc", [])


def test_a_failed_exec_falls_back_to_tuned_glibc(process: Any) -> None:
    process.exec_error = PermissionError(13, "Permission denied")
    got = prepare("auto", [])
    assert (got.name, got.how) == ("glibc", "tuned") and "Permission denied" in got.note


def test_another_libc_is_left_as_it_is(process: Any) -> None:
    process.glibc, process.jemalloc = False, None
    assert prepare("auto", []).how == "untouched"
    assert process.libc.calls == []


# -- the early re-exec, before the settings are imported ---------------------------------------------
def test_the_early_step_reads_the_allocator_knob_as_the_settings_declare_it() -> None:
    assert settings.env_name("allocator") == reexec.ALLOCATOR_ENV
    assert build([], environ={}).allocator == reexec.ALLOCATOR_DEFAULT
    assert build([reexec.ALLOCATOR_FLAG, "glibc"], environ={}).allocator == "glibc"
    assert set(reexec.REEXEC_MODES) < set(settings.ALLOCATORS)


@pytest.mark.parametrize(("argv", "environ", "mode"), [
    ([], {}, "auto"),
    (["--port", "9000"], {"COALESCE_ALLOCATOR": "glibc"}, "glibc"),
    (["--allocator", "system"], {"COALESCE_ALLOCATOR": "jemalloc"}, "system"),
    (["--allocator=glibc", "--allocator", "jemalloc"], {}, "jemalloc"),  # the last one, as argparse
    (["--alloc", "glibc"], {}, None),  # an abbreviation: argparse's business
    (["--allocator=auto", "--a=glibc"], {}, None),
    (["--allocator"], {}, None),
])
def test_the_early_step_knows_the_mode_only_where_it_is_plain(
    argv: list[str], environ: dict[str, str], mode: str | None,
) -> None:
    assert reexec.asked_mode(argv, environ) == mode


@pytest.mark.parametrize("argv", [
    [], ["--port", "9000"], ["--allocator", "jemalloc"], ["--allocator=auto", "--workers", "2"],
    ["--allocator", "glibc"], ["--allocator", "system"], ["--alloc", "glibc"], ["--al=system"],
])
@pytest.mark.parametrize("variable", [None, "glibc", "system", "jemalloc"])
def test_the_early_step_reexecutes_only_where_prepare_would_and_as_it_would(
    process: Any, monkeypatch: pytest.MonkeyPatch, argv: list[str], variable: str | None,
) -> None:
    environ = {} if variable is None else {"COALESCE_ALLOCATOR": variable}
    if variable is not None:
        monkeypatch.setenv("COALESCE_ALLOCATOR", variable)
    sys.argv[:] = ["/venv/bin/coalesce", "serve", *argv]
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", *sys.argv])
    try:
        reexec.early(argv)
    except Exec as early:
        mode = build(argv, environ=environ).allocator
        assert mode in ("auto", "jemalloc")
        with pytest.raises(Exec) as later:
            prepare(mode, argv)
        assert (early.path, early.argv, early.env) == (later.value.path, later.value.argv, later.value.env)
    else:
        abbreviated = any(a.startswith("--al") and not a.startswith("--allocator") for a in argv)
        assert abbreviated or build(argv, environ=environ).allocator not in ("auto", "jemalloc")


def test_the_early_step_leaves_to_prepare_whatever_is_not_a_plain_reexec(
    process: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    process.maps = JEMALLOC_MAPS  # preloaded already
    reexec.early([])
    process.maps, process.glibc = GLIBC_MAPS, False  # another libc
    reexec.early([])
    process.glibc, process.jemalloc = True, None  # not installed: prepare names the package
    reexec.early(["--allocator", "jemalloc"])
    process.jemalloc, process.exec_error = JEMALLOC, PermissionError(13, "Permission denied")
    reexec.early([])  # a failed exec: prepare tries again and says why
    process.exec_error = None
    monkeypatch.setenv(REEXEC_MARKER, JEMALLOC)  # the re-executed process itself
    reexec.early([])


def test_glibc_is_told_without_ctypes() -> None:
    assert reexec.glibc() == allocator.libc_is_glibc()


# -- trimming after batches --------------------------------------------------------------------------
def _wait_for(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_the_trimmer_trims_after_batches_and_sleeps_while_idle() -> None:
    trims: list[str] = []
    trimmer = Trimmer(lambda: trims.append(threading.current_thread().name), every_s=0.05)
    trimmer.start()
    try:
        time.sleep(0.3)
        assert trims == []  # no batch yet: nothing to give back, and no polling
        for _ in range(100):
            trimmer.batch_done()
        assert _wait_for(lambda: len(trims) >= 1)
        time.sleep(0.3)
        assert len(trims) == 1  # one trim for the burst, then asleep until the next batch
        trimmer.batch_done()
        assert _wait_for(lambda: len(trims) == 2)
        assert trims[0] == "coalesce-trim" and trimmer.trims == 2
    finally:
        trimmer.close()
    assert not trimmer._thread.is_alive()


def test_the_process_gets_a_trimmer_where_glibc_was_tuned(process: Any) -> None:
    assert Trimmer.for_process("system") is None
    trimmer = Trimmer.for_process("auto")
    assert trimmer is not None
    try:
        trimmer._every = 0.01
        trimmer.batch_done()
        assert _wait_for(lambda: ("malloc_trim", (0,)) in process.libc.calls)
    finally:
        trimmer.close()
    process.glibc = False  # another libc, nothing preloaded: left alone
    assert Trimmer.for_process("auto") is None


class FakeJemalloc:
    def __init__(self, controls: bool = True) -> None:
        self.controls = controls
        self.calls: list[str] = []

    def keep_freed_pages(self) -> bool:
        self.calls.append("keep")
        return self.controls

    def purge(self) -> bool:
        self.calls.append("purge")
        return True


def test_on_jemalloc_with_our_options_the_engine_keeps_freed_pages_and_purges_after_batches(
    process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[str, FakeJemalloc]] = []

    def fake(library: str, controls: bool = True) -> FakeJemalloc:
        made.append((library, FakeJemalloc(controls)))
        return made[-1][1]

    monkeypatch.setattr(allocator, "_jemalloc", fake)
    process.maps = JEMALLOC_MAPS
    for conf in (None, allocator.JEMALLOC_CONF):  # preloaded with no options, or re-executed with ours
        if conf is None:
            monkeypatch.delenv("MALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("MALLOC_CONF", conf)
        trimmer = Trimmer.for_process("auto")
        assert trimmer is not None
        library, jemalloc = made[-1]
        try:
            assert library == JEMALLOC and jemalloc.calls == ["keep"]  # before any batch
            trimmer._every = 0.01
            trimmer.batch_done()
            assert _wait_for(lambda: jemalloc.calls == ["keep", "purge"])  # noqa: B023
            assert process.libc.calls == []  # no malloc_trim on jemalloc
        finally:
            trimmer.close()
    assert Trimmer.for_process("system") is None
    count = len(made)
    # An operator's own options are theirs (their decay included), and tcmalloc purges by itself.
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:5000")
    assert Trimmer.for_process("auto") is None
    monkeypatch.setenv("MALLOC_CONF", allocator.JEMALLOC_CONF)
    tc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    process.maps = GLIBC_MAPS + f"7f00-7f01 r-xp 00000000 fe:00 1 {tc}\n"
    assert Trimmer.for_process("auto") is None
    assert len(made) == count
    # A jemalloc whose controls refuse keeps its own decay: no trimmer.
    process.maps = JEMALLOC_MAPS
    monkeypatch.setattr(allocator, "_jemalloc", lambda library: fake(library, controls=False))
    assert Trimmer.for_process("auto") is None and made[-1][1].calls == ["keep"]


_KEPT_THEN_PURGED = """
import json, os, numpy as np
from coalesce.service.allocator import Jemalloc, Trimmer, _self_maps, mapped

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

trimmer = Trimmer.for_process("auto")
jemalloc = Jemalloc(mapped(_self_maps())[1])
before = rss()
block = np.ones(256 << 20, dtype=np.uint8)  # 256 MiB, touched
del block
import time; time.sleep(2.5)  # more than our options' one-second decay
kept = rss()
ok = jemalloc.purge()
print(json.dumps({"trimmer": trimmer is not None, "decay": jemalloc.decay_ms(), "before": before,
                  "kept": kept, "purged": rss(), "ok": ok}))
trimmer.close()
"""


@pytest.mark.skipif(allocator.find_jemalloc() is None, reason="jemalloc is not installed (libjemalloc2)")
def test_on_real_jemalloc_freed_pages_stay_until_the_purge_gives_them_back() -> None:
    library = allocator.find_jemalloc() or ""
    env = {**os.environ, "LD_PRELOAD": library, "MALLOC_CONF": allocator.JEMALLOC_CONF}
    out = subprocess.run([sys.executable, "-c", _KEPT_THEN_PURGED], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["trimmer"] and seen["decay"] == -1 and seen["ok"], seen
    assert seen["kept"] - seen["before"] > 200, seen  # freed, but kept for the next batch: no decay
    assert seen["purged"] - seen["before"] < 56, seen  # the purge hands it back


def test_the_device_thread_reports_every_batch_on_itself() -> None:
    seen: list[str] = []
    device = DeviceThread("hook", after_batch=lambda: seen.append(threading.current_thread().name))
    runner = FakeRunner()
    for overlap in (False, True):
        worker = ModelWorker(runner, device, overlap=overlap)
        asyncio.run(worker.run([[1, 2, 3], [4, 5]]))
        worker.close()
    device.close()
    assert len(seen) == 2 and all(name.startswith("coalesce-hook") for name in seen)


# -- oneDNN's kernel caches ----------------------------------------------------------------------------
KERNEL_CACHE_PROBE = """
import sys
from coalesce.service.allocator import bound_kernel_caches
print(bound_kernel_caches(int(sys.argv[1])), flush=True)
import torch
from coalesce.kernels.cpu_forward import PackedLinear, packing_unavailable
if packing_unavailable():
    print("unavailable", flush=True)
    raise SystemExit(0)
layer = PackedLinear(torch.nn.Linear(32, 32))
with torch.inference_mode():
    for _ in range(3):
        for rows in (3, 5, 7):  # three shapes, three times: two entries cannot hold them
            layer(torch.randn(rows, 32))
"""


def kernel_cache_probe(entries: int, env: dict[str, str]) -> tuple[str, int, int]:
    """Run a packed linear layer at three shapes three times in a fresh process that first bounds the
    caches at ``entries``; oneDNN's verbose log counts kernels built (cache misses) and reused (hits)."""
    clean = {k: v for k, v in os.environ.items() if k not in allocator.KERNEL_CACHE_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", KERNEL_CACHE_PROBE, str(entries)], capture_output=True, text=True, timeout=120,
        env={**clean, "ONEDNN_VERBOSE": "2", **env}, check=True,
    ).stdout
    if "unavailable" in out:
        pytest.skip("this torch cannot pack linear weights for oneDNN")
    return out.splitlines()[0], out.count("create:cache_miss"), out.count("create:cache_hit")


def test_bounded_kernel_caches_build_a_kernel_again_for_shapes_they_no_longer_hold() -> None:
    said, built, reused = kernel_cache_probe(2, {})
    assert said == str({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2", "LRU_CACHE_CAPACITY": "2"})
    assert reused == 0 and built >= 9  # every shape's kernel was evicted before it came round again
    said, built, reused = kernel_cache_probe(0, {})  # 0: the libraries' defaults (1,024 entries)
    assert said == "{}" and reused >= 6 and built < 9  # the second and third rounds find their kernels


def test_the_operators_own_kernel_cache_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    said, _built, reused = kernel_cache_probe(2, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"})
    assert said == str({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "2"})
    assert reused >= 6
    for name in allocator.KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "300")
    assert allocator.bound_kernel_caches(64) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "300"
    }
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_the_kernel_cache_knob_defaults_to_64_and_refuses_a_negative_size() -> None:
    assert build([]).cpu_kernel_cache == 64
    assert build(["--cpu-kernel-cache", "0"]).cpu_kernel_cache == 0
    with pytest.raises(SystemExit):
        build(["--cpu-kernel-cache", "-1"])


# -- resident memory in /metrics ---------------------------------------------------------------------
def test_one_process_reports_its_resident_memory() -> None:
    text = Metrics().render().decode()
    line = next(x for x in text.splitlines() if x.startswith("process_resident_memory_bytes "))
    assert float(line.split()[1]) > 1 << 20


def test_a_replica_reports_the_resident_memory_of_each_live_process(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    metrics = Metrics()
    metrics.multiprocess_dir = str(tmp_path)  # as under --workers (PROMETHEUS_MULTIPROC_DIR)
    assert "process_resident_memory_bytes{" not in metrics.render().decode()  # not named yet
    write_processes(str(tmp_path), {os.getpid(): "engine", gone.pid: "gateway-0"})
    text = metrics.render().decode()
    lines = [x for x in text.splitlines() if x.startswith("process_resident_memory_bytes")]
    assert len(lines) == 1 and lines[0].startswith('process_resident_memory_bytes{process="engine"} ')
    assert float(lines[0].split()[1]) > 1 << 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["processes"]
