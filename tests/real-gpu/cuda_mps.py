#!/usr/bin/env python3
"""What a CUDA client sees of its MPS caps, through the CUDA driver API alone (libcuda.so.1
via ctypes; nothing to install on a GPU machine).

Usage: cuda_mps.py [--alloc MIB]... [--calibrate MS] [--work ITERATIONS] [--hold]
On CUDA device 0: prints one JSON line with
  "sms"     the multiprocessor count the client sees (MPS's active thread percentage
            shows here),
  "total", "free"  what cuMemGetInfo reports,
  "allocs"  {MIB: CUresult} for each --alloc (2 is CUDA_ERROR_OUT_OF_MEMORY, 0 it worked;
            each is freed before the next),
  "iterations"  with --calibrate MS: how many iterations of the work kernel take about
            MS milliseconds on this client's SMs,
  "work_ms" with --work ITERATIONS: how long that many iterations took on one block per
            SM the client sees, by the host's clock, and "work_start", "work_end" (Unix
            seconds): two clients on one GPU that run side by side each take about as
            long as alone; time-sliced, about twice as long,
  "mps"     whether CUDA_MPS_PIPE_DIRECTORY was set.
With --hold it then waits for its stdin to close.
"""

import ctypes
import json
import os
import sys
import time

# A kernel of fixed work, one thread a block: `iterations` steps of a dependent 64-bit
# multiply-add, its result stored only if it is zero (never), so that nothing optimises the
# loop away. A fixed amount of work rather than a spin on the SM clock: the clock runs on
# while another context has the GPU, so a clock-bound kernel takes as long time-sliced as
# alone, and a fixed one twice as long.
WORK_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry work(.param .u64 iterations, .param .u64 out)
{
    .reg .u64 %rd<8>;
    .reg .pred %p;
    ld.param.u64 %rd1, [iterations];
    ld.param.u64 %rd2, [out];
    mov.u64 %rd3, 0;
    mov.u64 %rd4, 1;
    mov.u64 %rd5, 6364136223846793005;
    mov.u64 %rd6, 1442695040888963407;
LOOP:
    mad.lo.u64 %rd4, %rd4, %rd5, %rd6;
    add.u64 %rd3, %rd3, 1;
    setp.lt.u64 %p, %rd3, %rd1;
    @%p bra LOOP;
    setp.eq.u64 %p, %rd4, 0;
    @%p st.global.u64 [%rd2], %rd4;
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
    allocs, calibrate_ms, iterations, hold = [], None, None, False
    while args:
        flag = args.pop(0)
        if flag == "--alloc":
            allocs.append(int(args.pop(0)))
        elif flag == "--calibrate":
            calibrate_ms = float(args.pop(0))
        elif flag == "--work":
            iterations = int(args.pop(0))
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
    if calibrate_ms is not None or iterations is not None:
        module, function, out = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
        check(cuda.cuModuleLoadData(ctypes.byref(module), WORK_PTX), "cuModuleLoadData")
        check(cuda.cuModuleGetFunction(ctypes.byref(function), module, b"work"), "cuModuleGetFunction")
        check(cuda.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(8)), "cuMemAlloc")

        def work(n):
            """Runs `n` iterations on one block per SM the client sees: (start, end), by
            the host's wall clock, which two clients' runs can be compared on."""
            count = ctypes.c_uint64(n)
            params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(count), ctypes.c_void_p),
                                           ctypes.cast(ctypes.byref(out), ctypes.c_void_p))
            started = time.time()
            check(cuda.cuLaunchKernel(function, sms.value, 1, 1, 1, 1, 1, 0, None, params, None),
                  "cuLaunchKernel")
            check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
            return started, time.time()

        work(1 << 12)  # loads the module onto the GPU
        if calibrate_ms is not None:
            n = 1 << 20
            for _ in range(2):
                started, ended = work(n)
                n = int(n * calibrate_ms / max((ended - started) * 1000, 0.1))
            seen["iterations"] = n
        if iterations is not None:
            started, ended = work(iterations)
            seen["work_ms"] = round((ended - started) * 1000, 1)
            seen["work_start"], seen["work_end"] = started, ended
    print(json.dumps(seen), flush=True)
    if hold:
        sys.stdin.read()


if __name__ == "__main__":
    main()
