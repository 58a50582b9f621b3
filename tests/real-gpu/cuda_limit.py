#!/usr/bin/env python3
"""What a workload sees of its memory limit, through the CUDA driver API alone
(libcuda.so.1 via ctypes; nothing to install on a GPU machine).

Usage: cuda_limit.py BIG_MIB SMALL_MIB
On CUDA device 0 (the first GPU CUDA_VISIBLE_DEVICES names): prints one JSON line with the
total and free memory cuMemGetInfo reports, the CUresult of allocating BIG_MIB (2 is
CUDA_ERROR_OUT_OF_MEMORY) and of allocating SMALL_MIB (0: it worked), then waits for its
stdin to close.
"""

import ctypes
import json
import sys


def main():
    big, small = int(sys.argv[1]), int(sys.argv[2])
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        sys.exit("cuda_limit: cuInit failed")
    device = ctypes.c_int()
    context = ctypes.c_void_p()
    cuda.cuDeviceGet(ctypes.byref(device), 0)
    if cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) != 0:
        sys.exit("cuda_limit: cuCtxCreate failed")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    pointer = ctypes.c_uint64()
    big_result = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(big << 20))
    if big_result == 0:
        cuda.cuMemFree_v2(pointer)
    small_result = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(small << 20))
    print(json.dumps({"total": total.value, "free": free.value,
                      "big": big_result, "small": small_result}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
