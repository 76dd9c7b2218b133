"""Several torchrun agents on one machine, acting as the nodes of a multi-node job (used by ``launch.torchrun(nnodes=N)``).

On a cluster you start one ``torchrun`` per node; they meet at a c10d rendezvous on the first node and agree on
every worker's RANK. This module does the same on one machine: agent ``i`` is "node i", all meet at
127.0.0.1, and their output is merged into one stream (each line already carries its global rank prefix).

    python -m helpers.launch.nodes --nnodes 2 --port 29400 --log-dir runs/x/elastic -- \\
        --nproc-per-node 1 train.py --epochs 1
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import uuid


def agent_command(node: int, nnodes: int, port: int, rdzv_id: str, log_dir: str, torchrun_args: list[str]) -> list[str]:
    """The torchrun command node ``node`` would run on a cluster, with 127.0.0.1 standing in for the hosts."""
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            # node 0 hosts the rendezvous store; on a cluster that is the MASTER_ADDR machine
            "--rdzv-conf", f"is_host={int(node == 0)}",
            "--local-addr", "127.0.0.1",  # the address the other nodes reach this one at
            "--log-dir", os.path.join(log_dir, f"node{node}"),
            *torchrun_args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    rdzv_id = uuid.uuid4().hex[:8]
    agents = [subprocess.Popen(agent_command(i, args.nnodes, args.port, rdzv_id, args.log_dir, rest),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
              for i in range(args.nnodes)]
    lock = threading.Lock()

    def pump(node, proc):
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            with lock:  # one line at a time, never two agents' halves interleaved
                sys.stdout.write(line if line.startswith("[rank") else f"[node{node}] {line}")
                sys.stdout.flush()

    pumps = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(agents)]
    for t in pumps:
        t.start()

    def stop(signum, frame):  # the launcher's kill reaches us first: take the agents with us
        for p in agents:
            p.send_signal(signal.SIGTERM)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    codes = [p.wait() for p in agents]
    for t in pumps:
        t.join(timeout=5)
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
