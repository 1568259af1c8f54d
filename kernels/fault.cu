/* SPDX-License-Identifier: MIT */
/* The test-only device fault of cuda_fault.cuh. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels/cuda_fault.cuh"
#include "kernels/cuda_util.cuh"

/* An address no allocation has: the store faults with cudaErrorIllegalAddress. */
#define DSV4_CUDA_FAULT_ADDRESS ((uintptr_t)16)

static __global__ void fault_kernel(int *p)
{
    *p = 1;
}

int dsv4_cuda_test_fault(cudaStream_t s)
{
    /* Read once; the engine thread alone calls this. -1: off. */
    static long long left = -2;
    if (left == -2) {
        const char *v = getenv("DSV4_TEST_CUDA_FAULT_AFTER_DECODES");
        left = v && *v ? strtoll(v, NULL, 10) : -1;
    }
    if (left < 0 || left-- > 0)
        return 0;
    fault_kernel<<<1, 1, 0, s>>>(reinterpret_cast<int *>(DSV4_CUDA_FAULT_ADDRESS));
    DSV4_CUDA_LAUNCHED("the test fault kernel");
    return 0;
}
