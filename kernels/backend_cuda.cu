/* dsv4_backend_cuda_create (engine/backend.h). The kernels of the decode step that exist so far
 * (linears in every checkpoint format, FP4 experts, router, RMSNorm, mHC) are not yet assembled into
 * a step: attention, the compressors and the indexer have no CUDA kernels. Until they do, create
 * answers -ENOSYS before touching the device, so `--backend auto` falls back to the CPU and says why
 * instead of booting a backend that cannot serve. */
#include "kernels/cuda_util.cuh"

extern "C" int dsv4_backend_cuda_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                                        struct dsv4_backend **ret)
{
    if (dsv4_cuda_device_count() == 0)
        return -ENODEV;
    return dsv4_error_set(-ENOSYS, "cuda backend: the decode step is not assembled yet (attention, "
                          "compressor and indexer kernels are missing); use --backend cpu");
}
