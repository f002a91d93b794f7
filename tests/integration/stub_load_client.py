"""A stand-in for a ``service_load`` client process that sends nothing: it speaks the protocol
(``ready``, then waits for ``go`` on stdin, then ``result`` and a JSON object) and logs when it was
ready and when it was told to go (``STUB_EVENTS``). It gets ready after a random pause of up to 0.6 s,
and reports 10 × (its pid's last digit + 1) requests over 2 s per client thread."""

from __future__ import annotations

import json
import os
import random
import sys
import time


def event(line: str) -> None:
    with open(os.environ["STUB_EVENTS"], "a") as f:
        f.write(line + "\n")


def main() -> int:
    threads = int(sys.argv[1])
    time.sleep(random.uniform(0.0, 0.6))
    event(f"ready {time.time():.6f}")
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    done = 10 * (os.getpid() % 10 + 1)
    event(f"go {time.time():.6f} {done * threads}")
    report = {"done": [done] * threads, "errors": [0] * threads, "elapsed": [2.0] * threads,
              "latencies_ms": [1.0] * (done * threads)}
    print("result " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
