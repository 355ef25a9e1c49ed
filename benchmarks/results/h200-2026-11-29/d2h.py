"""Ceilings for the HMM's end-to-end rate on a GPU host, measured beside `benchmarks/gpu.py` (2026-11-29, H200).

One chunk of the paper HMM's conditionals is 65536 x 16 x 200 float32 = 839 MB. Times (medians of 7, seconds):
- torch: device-to-host copy into a pinned buffer allocated once, and into pageable memory (the PCIe ceiling);
- torch: allocating that pinned buffer (cudaHostAlloc), which a fresh JAX `pinned_host` array may pay per call;
- numpy: one host memcpy of that size (what `HMM._run` pays to place each chunk into its output array).
Prints one JSON line; GB/s count the bytes once."""

import json
import sys
import time

import numpy as np

SHAPE = (65536, 16, 200)


def med(fn, n=7):
    fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def main():
    nbytes = int(np.prod(SHAPE)) * 4
    res = {"bytes": nbytes}
    src = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    dst = np.empty_like(src)
    res["numpy_memcpy_s"] = med(lambda: np.copyto(dst, src))
    try:
        import torch
        x = torch.rand(SHAPE, device="cuda")
        pinned = torch.empty(SHAPE, pin_memory=True)

        def to_pinned():
            pinned.copy_(x, non_blocking=True)
            torch.cuda.synchronize()

        def to_pageable():
            x.cpu()

        res["torch_d2h_pinned_s"] = med(to_pinned)
        res["torch_d2h_pageable_s"] = med(to_pageable)
        res["torch_pin_alloc_s"] = med(lambda: torch.empty(SHAPE, pin_memory=True), n=3)
    except Exception as e:  # noqa: BLE001 - the numpy row still counts
        res["torch_error"] = f"{type(e).__name__}: {e}"
    for k in [k for k in res if k.endswith("_s")]:
        res[k.replace("_s", "_gb_per_s")] = nbytes / res[k] / 1e9
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
