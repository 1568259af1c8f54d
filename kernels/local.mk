# SPDX-License-Identifier: MIT
# kernels/: the CUDA backend, built into libdsv4cuda.a by nvcc when configure found it.
# Programs that link libdsv4engine.la and want the CUDA backend add $(DSV4_CUDA_LDADD) to their LDADD
# (empty without CUDA) and $(DSV4_CUDA_CPPFLAGS) to their CFLAGS (defines nothing without CUDA).

DSV4_CUDA_SRC_FILES = kernels/device.cu kernels/expert_fetch.cu kernels/gemv.cu kernels/gemm.cu kernels/gemm_wgmma.cu kernels/gemm_direct.cu kernels/indexer.cu kernels/sample.cu kernels/moe.cu kernels/moe_wgmma.cu kernels/norm.cu kernels/attention.cu \
	kernels/compressor.cu kernels/step.cu kernels/mhc.cu kernels/embed.cu kernels/prefix.cu kernels/fault.cu \
	kernels/route_stats.cu kernels/spec.cu kernels/ep.cu kernels/ep_backend.cu
DSV4_CUDA_HDR_FILES = kernels/dsv4cuda.h kernels/cuda_util.cuh kernels/cuda_fault.cuh kernels/kernels_internal.h kernels/kv_entry.cuh kernels/index_key.cuh kernels/sample.h kernels/mma.cuh kernels/norm_row.cuh kernels/gemm_tile.cuh kernels/wgmma.cuh \
	kernels/pending.cuh kernels/prefix.h kernels/moe_tile.cuh kernels/route_score.cuh kernels/step_internal.h
EXTRA_DIST += $(DSV4_CUDA_SRC_FILES) $(DSV4_CUDA_HDR_FILES) kernels/NOTES.md

GPU_TEST_COMMON = tests/gpu/gpu_test.h

# The switch table is plain C: CPU-only builds test it, and the documentation against it.
check_PROGRAMS += tests/unit/test_cuda_switches
TESTS += tests/unit/test_cuda_switches
tests_unit_test_cuda_switches_SOURCES = tests/unit/test_cuda_switches.c kernels/switches.c kernels/switches.h
tests_unit_test_cuda_switches_CFLAGS = $(TEST_ENGINE_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_unit_test_cuda_switches_LDADD = $(TEST_ENGINE_LIBS)

# A checkpoint at real V4 shapes with random weights, in the release's formats (Python + numpy).
dist_noinst_SCRIPTS += tools/dsv4-mkckpt

if HAVE_CUDA
noinst_LIBRARIES += libdsv4cuda.a
libdsv4cuda_a_SOURCES = $(DSV4_CUDA_SRC_FILES) $(DSV4_CUDA_HDR_FILES)
libdsv4cuda_a_SOURCES += kernels/switches.c kernels/switches.h

# Machine code for Hopper (sm_90a: H100/H200), Blackwell (sm_100a) and RTX PRO 6000 (sm_120a), plus
# compute_80 PTX as the portable fallback the driver compiles at load on anything else; the boot log
# and stats name which image runs (dsv4_cuda_dev_stats.kernel_build). Override NVCC_GENCODE to build
# fewer targets while developing.
NVCC_GENCODE = -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a \
	-gencode=arch=compute_120a,code=sm_120a -gencode=arch=compute_80,code=compute_80
DSV4_NVCCFLAGS = -std=c++17 -O3 $(NVCC_GENCODE) -I$(top_srcdir) -I$(top_builddir) \
	-Xcompiler -Wall,-Wextra,-Wshadow,-Wno-unused-parameter,-fno-strict-aliasing
SUFFIXES = .cu
.cu.o:
	$(AM_V_GEN)$(NVCC) $(DSV4_NVCCFLAGS) $(NVCCFLAGS) -c -o $@ $<
$(libdsv4cuda_a_OBJECTS): $(DSV4_CUDA_HDR_FILES) engine/model/weights.h engine/model/placement.h engine/backend.h engine/model/config.h engine/error.h

DSV4_CUDA_LDADD = libdsv4cuda.a $(CUDA_LIBS) -lstdc++
DSV4_CUDA_CPPFLAGS = $(CUDA_CFLAGS)

# Per-kernel timings beside the bytes each must move (tools/dsv4-bench.c).
bin_PROGRAMS += dsv4-bench
dsv4_bench_SOURCES = tools/dsv4-bench.c
dsv4_bench_CFLAGS = $(AM_CFLAGS) $(CUDA_CFLAGS)
dsv4_bench_LDADD = $(DSV4_CUDA_LDADD) libdsv4engine.la -lm

GPU_TESTS += tests/gpu/test_gpu_linear tests/gpu/test_gpu_moe tests/gpu/test_gpu_norm tests/gpu/test_gpu_device \
	tests/gpu/test_gpu_step tests/gpu/test_gpu_codec tests/gpu/test_gpu_serve tests/gpu/test_gpu_sample \
	tests/gpu/test_gpu_attention tests/gpu/test_gpu_indexer tests/gpu/test_gpu_prefix tests/gpu/test_gpu_fault \
	tests/gpu/test_gpu_offload tests/gpu/test_gpu_spec tests/gpu/test_gpu_ep
check_PROGRAMS += $(GPU_TESTS)
GPU_TEST_CFLAGS = $(TEST_ENGINE_CFLAGS) $(CUDA_CFLAGS)
GPU_TEST_LIBS = $(DSV4_CUDA_LDADD) $(TEST_ENGINE_LIBS) -lm
tests_gpu_test_gpu_linear_SOURCES = tests/gpu/test_gpu_linear.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_linear_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_linear_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_moe_SOURCES = tests/gpu/test_gpu_moe.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_moe_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_moe_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_norm_SOURCES = tests/gpu/test_gpu_norm.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_norm_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_norm_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_device_SOURCES = tests/gpu/test_gpu_device.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_device_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_device_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_codec_SOURCES = tests/gpu/test_gpu_codec.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_codec_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_codec_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_offload_SOURCES = tests/gpu/test_gpu_offload.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_offload_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_offload_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_step_SOURCES = tests/gpu/test_gpu_step.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_step_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_step_LDADD = $(GPU_TEST_LIBS) $(JANSSON_LIBS)
tests_gpu_test_gpu_serve_SOURCES = tests/gpu/test_gpu_serve.c tests/unit/sched_harness.h $(GPU_TEST_COMMON)
tests_gpu_test_gpu_serve_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_serve_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_sample_SOURCES = tests/gpu/test_gpu_sample.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_sample_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_sample_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_attention_SOURCES = tests/gpu/test_gpu_attention.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_attention_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_attention_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_indexer_SOURCES = tests/gpu/test_gpu_indexer.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_indexer_CFLAGS = $(GPU_TEST_CFLAGS)
tests_gpu_test_gpu_indexer_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_prefix_SOURCES = tests/gpu/test_gpu_prefix.c tests/unit/sched_harness.h tests/unit/prefix_util.h $(GPU_TEST_COMMON)
tests_gpu_test_gpu_prefix_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_prefix_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_fault_SOURCES = tests/gpu/test_gpu_fault.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_fault_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_fault_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_spec_SOURCES = tests/gpu/test_gpu_spec.c tests/unit/sched_harness.h $(GPU_TEST_COMMON)
tests_gpu_test_gpu_spec_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_spec_LDADD = $(GPU_TEST_LIBS)
tests_gpu_test_gpu_ep_SOURCES = tests/gpu/test_gpu_ep.c $(GPU_TEST_COMMON)
tests_gpu_test_gpu_ep_CFLAGS = $(GPU_TEST_CFLAGS) -DDSV4_SRCDIR='"$(abs_top_srcdir)"'
tests_gpu_test_gpu_ep_LDADD = $(GPU_TEST_LIBS)
else
DSV4_CUDA_LDADD =
DSV4_CUDA_CPPFLAGS =
EXTRA_DIST += tools/dsv4-bench.c $(GPU_TEST_COMMON) tests/gpu/test_gpu_linear.c tests/gpu/test_gpu_moe.c \
	tests/gpu/test_gpu_norm.c tests/gpu/test_gpu_device.c tests/gpu/test_gpu_step.c \
	tests/gpu/test_gpu_codec.c tests/gpu/test_gpu_serve.c tests/gpu/test_gpu_sample.c \
	tests/gpu/test_gpu_attention.c tests/gpu/test_gpu_indexer.c tests/gpu/test_gpu_prefix.c tests/gpu/test_gpu_fault.c \
	tests/gpu/test_gpu_spec.c tests/gpu/test_gpu_ep.c
endif
