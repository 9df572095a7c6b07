"""Multi-process CPU tests of the distributed code: ``spawn_gloo(check, world)`` runs ``check(rank, world)`` on
``world`` gloo ranks (``check`` must be a module-level function, so the spawned processes can import it) and fails
the test with every failing rank's traceback."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank, world, port, err_dir, check):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        check(rank, world)
        dist.barrier()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn_gloo(check, world: int) -> None:
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.spawn(_run, args=(world, free_port(), err_dir, check), nprocs=world, join=True)
        except Exception:
            msgs = [open(os.path.join(err_dir, f)).read() for f in sorted(os.listdir(err_dir))]
            pytest.fail("\n".join(msgs) or "a worker failed")
