"""One rank of a job whose other ranks may never start; run with ``sys.executable`` by the tests.

Usage: ``python _absent_rank_job.py INIT_TIMEOUT use|exit [linger]`` with torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set. It prints ``ready`` once imported and starts
initialising when a line arrives on stdin, so that every rank starts at the same moment however
long its imports took. ``use`` then calls ``all_reduce`` and lets its error end the process the
way a user's script ends; ``exit`` returns at once, while initialisation is still pending.
With ``linger``, a rank other than 0 keeps finalising (a module-level object's finaliser) until
the rendezvous store stops accepting connections (its host, rank 0, has exited; at most 60 s),
so the connections rank 0 held are closed while this rank's interpreter shuts down.

On stdout: ``init-start T`` and, from the last exit handler to run (registered before mccl's),
``exit-ready T``; T is ``time.time()``. What follows is the interpreter's own teardown.
"""

from __future__ import annotations

import _socket
import atexit
import functools
import os
import sys
import time

atexit.register(lambda: print(f"exit-ready {time.time()!r}", flush=True))

import torch  # noqa: E402 - after the exit handler above, so that it runs after mccl's
import torch.distributed as dist  # noqa: E402

import mccl  # noqa: E402


class _LingerUntilStoreCloses:
    def __init__(self) -> None:
        # Only C-level callables, bound now: the finaliser runs while modules are torn down.
        self.address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.new_socket = functools.partial(_socket.socket, _socket.AF_INET, _socket.SOCK_STREAM)
        self.sleep, self.clock = time.sleep, time.monotonic

    def __del__(self) -> None:
        give_up = self.clock() + 60.0
        while self.clock() < give_up:
            probe = self.new_socket()
            probe.settimeout(1.0)
            refused = probe.connect_ex(self.address) != 0
            probe.close()
            if refused:
                return
            self.sleep(0.1)


def main(init_timeout: float, mode: str) -> None:
    print("ready", flush=True)
    sys.stdin.readline()
    print(f"init-start {time.time()!r}", flush=True)
    mccl.init_process_group("gloo", init_timeout=init_timeout)
    if mode == "use":
        dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    if sys.argv[3:] == ["linger"] and os.environ["RANK"] != "0":
        _linger = _LingerUntilStoreCloses()
    main(float(sys.argv[1]), sys.argv[2])
