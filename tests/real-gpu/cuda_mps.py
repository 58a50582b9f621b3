#!/usr/bin/env python3
"""What a CUDA client sees of its MPS caps, through the CUDA driver API alone (libcuda.so.1
via ctypes; nothing to install on a GPU machine).

Usage: cuda_mps.py [--alloc MIB]... [--spin MS] [--hold]
On CUDA device 0: prints one JSON line with
  "sms"     the multiprocessor count the client sees (MPS's active thread percentage
            shows here),
  "total", "free"  what cuMemGetInfo reports,
  "allocs"  {MIB: CUresult} for each --alloc (2 is CUDA_ERROR_OUT_OF_MEMORY, 0 it worked;
            each is freed before the next),
  "spin_ms" with --spin MS: how long a kernel that keeps every SM the client sees busy
            for about MS milliseconds took, by the host's clock (two clients on one GPU
            that run side by side take about as long as one alone; time-sliced, twice),
  "mps"     whether CUDA_MPS_PIPE_DIRECTORY was set.
With --hold it then waits for its stdin to close.
"""

import ctypes
import json
import os
import sys
import time

# A kernel that spins until the GPU's clock has advanced by `cycles`, one thread a block.
SPIN_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 cycles)
{
    .reg .u64 %rd<5>;
    .reg .pred %p;
    ld.param.u64 %rd1, [cycles];
    mov.u64 %rd2, %clock64;
LOOP:
    mov.u64 %rd3, %clock64;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra LOOP;
    ret;
}
\0"""

MULTIPROCESSOR_COUNT = 16
CLOCK_RATE = 13  # kHz


def check(result, what):
    if result != 0:
        sys.exit(f"cuda_mps: {what} failed ({result})")


def main():
    args = sys.argv[1:]
    allocs, spin_ms, hold = [], None, False
    while args:
        flag = args.pop(0)
        if flag == "--alloc":
            allocs.append(int(args.pop(0)))
        elif flag == "--spin":
            spin_ms = float(args.pop(0))
        elif flag == "--hold":
            hold = True
        else:
            sys.exit(f"cuda_mps: unknown argument {flag}")
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate")
    sms, khz = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(sms), MULTIPROCESSOR_COUNT, device)
    cuda.cuDeviceGetAttribute(ctypes.byref(khz), CLOCK_RATE, device)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    seen = {"sms": sms.value, "total": total.value, "free": free.value,
            "mps": "CUDA_MPS_PIPE_DIRECTORY" in os.environ, "allocs": {}}
    pointer = ctypes.c_uint64()
    for mib in allocs:
        result = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20))
        if result == 0:
            cuda.cuMemFree_v2(pointer)
        seen["allocs"][str(mib)] = result
    if spin_ms is not None:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuModuleLoadData(ctypes.byref(module), SPIN_PTX), "cuModuleLoadData")
        check(cuda.cuModuleGetFunction(ctypes.byref(function), module, b"spin"), "cuModuleGetFunction")
        cycles = ctypes.c_uint64(int(spin_ms * khz.value))
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(cycles), ctypes.c_void_p))
        # Warm up once, then time a launch of one block per SM the client sees.
        for timed in (False, True):
            started = time.monotonic()
            check(cuda.cuLaunchKernel(function, sms.value, 1, 1, 1, 1, 1, 0, None, params, None),
                  "cuLaunchKernel")
            check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
            if timed:
                seen["spin_ms"] = round((time.monotonic() - started) * 1000, 1)
    print(json.dumps(seen), flush=True)
    if hold:
        sys.stdin.read()


if __name__ == "__main__":
    main()
