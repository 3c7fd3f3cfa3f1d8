"""Hold a GPU's memory beyond a given free amount until stdin closes.

``benchmarks/kvcached_mode.py`` runs it so that kvcached instances, which have no shared
budget of their own, share exactly the benchmark's KV budget: whatever the device has free
beyond ``--leave-free`` bytes plus ``--leave-fraction`` of its total is allocated (in 1 GiB
tensors, then the rest), one JSON line
reports ``held``, ``free_after`` and ``device_total`` bytes, and the process waits for its
stdin to close, then exits (the memory goes back with it). Its own CUDA context is
allocated before it measures, so it counts itself.

    python3 -m benchmarks.gpu_ballast --leave-free 17179869184 < /dev/null   # a test: exits
"""

from __future__ import annotations

import argparse
import json
import sys

GiB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_ballast", description=__doc__)
    p.add_argument("--leave-free", type=int, required=True, help="bytes to leave free")
    p.add_argument(
        "--leave-fraction", type=float, default=0.0, help="and this fraction of the total"
    )
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    torch.cuda.set_device(args.device)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    hold = max(free - args.leave_free - int(args.leave_fraction * total), 0)
    blocks = []
    while hold > 0:
        n = min(hold, GiB)
        blocks.append(torch.empty(n, dtype=torch.uint8, device=f"cuda:{args.device}"))
        hold -= n
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    held = sum(b.numel() for b in blocks)
    print(json.dumps({"held": held, "free_after": free_after, "device_total": total}), flush=True)
    sys.stdin.read()  # until the benchmark closes it
    return 0


if __name__ == "__main__":
    sys.exit(main())
