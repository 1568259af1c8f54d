/* SPDX-License-Identifier: MIT */
/* Sticky CUDA errors. After one of these (a kernel that faulted, an uncorrectable ECC error) the
 * context is unusable: every later call fails the same way. The backend then reports
 * -ENOTRECOVERABLE (engine/backend.h) so the engine ends every request and dsv4d exits to be
 * restarted with a fresh context, instead of failing one step after another. */
#ifndef DSV4_KERNELS_CUDA_FAULT_CUH
#define DSV4_KERNELS_CUDA_FAULT_CUH

#include <errno.h>

#include <cuda_runtime.h>

/* The errno a failed CUDA call is reported with: -ENOTRECOVERABLE for a sticky error, else -EIO. */
static inline int dsv4_cuda_errno(cudaError_t e)
{
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContextIsDestroyed:
        return -ENOTRECOVERABLE;
    default:
        return -EIO;
    }
}

/* Test-only (DSV4_TEST_CUDA_FAULT_AFTER_DECODES=N): on the (N+1)th call, launch a kernel that writes
 * to an invalid device address on stream s, a real sticky fault that the next synchronisation
 * reports. Returns 0, or the launch error. Without the variable it does nothing. */
int dsv4_cuda_test_fault(cudaStream_t s);

#endif
