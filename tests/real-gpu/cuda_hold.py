#!/usr/bin/env python3
"""Holds GPU memory through the CUDA driver API alone (libcuda.so.1 via ctypes): a real
compute process for gpud's audit to find, with nothing to install on a GPU machine.

Usage: cuda_hold.py MIB [SECONDS]
Allocates MIB MiB on CUDA device 0 (the first GPU CUDA_VISIBLE_DEVICES names), prints
"holding N MiB on <uuid>" and sleeps SECONDS (default: until killed).
"""

import ctypes
import sys
import time


def check(result, what):
    if result != 0:
        sys.exit(f"cuda_hold: {what} failed with CUresult {result}")


def main():
    mib = int(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else None
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    device = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    uuid = (ctypes.c_ubyte * 16)()
    check(cuda.cuDeviceGetUuid(uuid, device), "cuDeviceGetUuid")
    h = bytes(uuid).hex()
    name = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    context = ctypes.c_void_p()
    check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate")
    pointer = ctypes.c_uint64()
    check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20)), "cuMemAlloc")
    print(f"holding {mib} MiB on {name}", flush=True)
    if seconds is None:
        while True:
            time.sleep(3600)
    time.sleep(seconds)


if __name__ == "__main__":
    main()
