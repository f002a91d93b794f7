"""``loadtests/procs.py``: the event loop's CPU is told apart from the process's other threads."""

from __future__ import annotations

import os
import threading
import time

from coalesce.loadtests.procs import cpu_seconds, main_thread_cpu_seconds


def test_main_thread_cpu_leaves_out_the_other_threads() -> None:
    # The overload bench charges refusals to the event loop (the main thread); forward threads that
    # spin while waiting must not count. A thread burns 0.2 s of its own CPU while the main thread
    # sleeps in join(): the process's CPU grows by it, the main thread's hardly.
    def burn() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass

    pid = os.getpid()
    main0, all0 = main_thread_cpu_seconds(pid), cpu_seconds(pid)
    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()
    main1, all1 = main_thread_cpu_seconds(pid), cpu_seconds(pid)
    assert all1 - all0 >= 0.15  # (clock ticks of 10 ms)
    assert main1 - main0 < 0.1
