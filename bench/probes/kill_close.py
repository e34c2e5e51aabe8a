"""How soon the kernel closes a SIGKILLed process's connections, by how much memory it held (issue 46 item 3).

A rank's death reaches the controller when its lifeline connection ends (``lora_cache/controller/lifelines.py``).
Linux tears a killed process down in ``do_exit``: its address space (``exit_mm``) before its open files
(``exit_files``), so the connection's end waits for the process's memory to be freed, and a rank with a large pinned
host tier is seen dead later than a small one. This probe starts a child that touches ``MB`` of memory (pinned with
``mlock`` where allowed, as the host arena is) and holds one TCP connection to the probe; the probe SIGKILLs it and
times the kill to the connection's end, per size, ``--kills`` times each, and prints the median and the worst.
``--pin cuda`` holds the memory pinned by CUDA instead (``torch``, as a GPU rank's host tier): on an H200 host its
16 GB cost 0.3 ms (the driver's pages are not freed in the process's own teardown), against 233 ms touched.

    python -m bench.probes.kill_close [--sizes 0,256,1024,4096] [--kills 5] [--pin mlock|cuda]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

_CHILD = r"""
import mmap, socket, sys
mb, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if how == "cuda":  # pinned by the CUDA driver, as a GPU rank's host tier is
    import torch
    buf = torch.ones(max(mb, 1) << 20, dtype=torch.uint8, pin_memory=True)
else:
    buf = mmap.mmap(-1, max(mb, 1) << 20)
    for i in range(0, len(buf), 4096):
        buf[i] = 1  # every page touched: resident, as the host tier's arena is
    try:
        import ctypes
        ctypes.CDLL(None).mlock(ctypes.c_void_p.from_buffer(buf), len(buf))
    except Exception:
        pass
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"up\n")
sys.stdin.read()
"""


def one_kill(mb: int, how: str = "mlock") -> float:
    """Seconds from the SIGKILL to the child's connection read as ended."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(mb), str(port), how], stdin=subprocess.PIPE)
        try:
            conn, _ = server.accept()
            with conn:
                assert conn.recv(3) == b"up\n"
                t0 = time.perf_counter()
                os.kill(child.pid, signal.SIGKILL)
                while conn.recv(64):
                    pass
                return time.perf_counter() - t0
        finally:
            child.kill()
            child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0,256,1024,4096", help="MB the child holds, comma-separated")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--pin", choices=("mlock", "cuda"), default="mlock",
                        help="how the child holds its memory: touched and mlocked, or pinned by CUDA (torch)")
    args = parser.parse_args()
    for mb in (int(s) for s in args.sizes.split(",")):
        times = sorted(one_kill(mb, args.pin) for _ in range(args.kills))
        print(f"{mb:>6} MB held ({args.pin}): kill -> connection end median {1000 * statistics.median(times):7.1f} ms, "
              f"worst {1000 * times[-1]:7.1f} ms ({args.kills} kills)")


if __name__ == "__main__":
    main()
