"""Does a small host->device copy_(non_blocking=True) return before the stream drains? Queue a long sleep kernel,
then time the host's share of a few copies per source kind. A copy whose host time is the sleep's waited for the
stream (a pageable source may: the driver stages it through pinned memory when the stream reaches it).
    python benchmarks/h2d_probe.py [--json out.json]"""

import argparse
import json
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    dst = torch.empty(4096, dtype=torch.int64, device="cuda")
    vals = list(range(64))
    kinds = {
        "pageable torch.tensor": lambda: torch.tensor(vals),
        "pinned .pin_memory()": lambda: torch.tensor(vals).pin_memory(),
        "pinned torch.empty(pin_memory) + fill": lambda: torch.empty(
            len(vals), dtype=torch.int64, pin_memory=True
        ).copy_(torch.tensor(vals)),
    }
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    # calibrate the sleep: ~20 ms
    t = time.perf_counter()
    torch.cuda._sleep(20_000_000)
    torch.cuda.synchronize()
    sleep_ms = 1e3 * (time.perf_counter() - t)
    rows = []
    for name, make in kinds.items():
        for size in (64, 4096):
            v = list(range(size))
            vals[:] = v
            for _ in range(2):  # warm the host allocator
                dst[:size].copy_(make(), non_blocking=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            t0 = time.perf_counter()
            for _ in range(3):
                dst[:size].copy_(make(), non_blocking=True)
            host_ms = 1e3 * (time.perf_counter() - t0)
            torch.cuda.synchronize()
            total_ms = 1e3 * (time.perf_counter() - t0)
            ok = dst[:size].tolist() == v
            rows.append(dict(kind=name, elems=size, host_ms_3_copies=host_ms, total_ms=total_ms, ok=ok))
            print(
                f"{name:40s} {size:5d}  host {host_ms:8.3f} ms for 3 copies   (sleep {sleep_ms:.1f} ms; total "
                f"{total_ms:.1f})  {'ok' if ok else 'WRONG'}"
            )
    if a.json:
        json.dump(
            dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, sleep_ms=sleep_ms, rows=rows),
            open(a.json, "w"),
            indent=1,
        )


if __name__ == "__main__":
    main()
