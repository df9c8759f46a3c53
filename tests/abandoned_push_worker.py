"""The two members of a weight push whose receiver never takes it, each in a process of its own.

    python tests/abandoned_push_worker.py member PORT   # joins, then takes nothing
    python tests/abandoned_push_worker.py sender PORT   # pushes, aborts after ABORT_AFTER_S, abandons the group, exits
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from vime import weight_sync  # noqa: E402

ABORT_AFTER_S = 2.0
BUCKET_BYTES = 32 << 20  # past the sockets' buffers, so the broadcast waits for its receiver


def main(role, port):
    rendezvous = {"master_addr": "127.0.0.1", "master_port": port, "world_size": 2, "device": "cpu"}
    group, _ = weight_sync.join_group(rendezvous, 0 if role == "sender" else 1)
    if role == "member":
        threading.Event().wait()
    tensors = [("t", torch.ones(BUCKET_BYTES // 4))]
    started = time.monotonic()
    try:
        weight_sync.send(group, weight_sync.bucket_layout(tensors, BUCKET_BYTES), tensors,
                         aborted=lambda: time.monotonic() - started > ABORT_AFTER_S)
    except weight_sync.PushBroken:
        weight_sync.abandon(group)
        print("abandoned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
