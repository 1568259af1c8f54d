# SPDX-License-Identifier: MIT
# engine/cpu/: the CPU reference backend (forward pass, per-sequence caches, backend ops), and the CUDA
# kernels' CPU twins, which only tests use.
libdsv4engine_la_SOURCES += \
	engine/cpu/cpu_forward.c engine/cpu/cpu_forward.h engine/cpu/cpu_ops.h \
	engine/cpu/cpu_ops.c engine/cpu/cpu_rope.c engine/cpu/cpu_mhc.c \
	engine/cpu/cpu_compressor.c engine/cpu/cpu_indexer.c engine/cpu/cpu_attention.c \
	engine/cpu/cpu_moe.c engine/cpu/cpu_pool.c engine/cpu/cpu_backend.c engine/cpu/cpu_prefix.c \
	engine/cpu/cpu_undo.c

# Unit tests of the pieces, each against doc/MODEL.md §3's formulas computed in double.
noinst_HEADERS += tests/unit/cpu_test_util.h
check_PROGRAMS += tests/unit/test_cpu_rope tests/unit/test_cpu_mhc tests/unit/test_cpu_compressor \
	tests/unit/test_cpu_moe tests/unit/test_cpu_backend
TESTS += tests/unit/test_cpu_rope tests/unit/test_cpu_mhc tests/unit/test_cpu_compressor \
	tests/unit/test_cpu_moe tests/unit/test_cpu_backend
tests_unit_test_cpu_rope_SOURCES = tests/unit/test_cpu_rope.c
tests_unit_test_cpu_rope_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_rope_LDADD = $(TEST_ENGINE_LIBS)
tests_unit_test_cpu_mhc_SOURCES = tests/unit/test_cpu_mhc.c
tests_unit_test_cpu_mhc_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_mhc_LDADD = $(TEST_ENGINE_LIBS)
tests_unit_test_cpu_compressor_SOURCES = tests/unit/test_cpu_compressor.c
tests_unit_test_cpu_compressor_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_compressor_LDADD = $(TEST_ENGINE_LIBS)
tests_unit_test_cpu_moe_SOURCES = tests/unit/test_cpu_moe.c
tests_unit_test_cpu_moe_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_moe_LDADD = $(TEST_ENGINE_LIBS)
tests_unit_test_cpu_backend_SOURCES = tests/unit/test_cpu_backend.c
tests_unit_test_cpu_backend_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_backend_LDADD = $(TEST_ENGINE_LIBS)
check_PROGRAMS += tests/unit/test_cpu_ep_split
TESTS += tests/unit/test_cpu_ep_split
tests_unit_test_cpu_ep_split_SOURCES = tests/unit/test_cpu_ep_split.c
tests_unit_test_cpu_ep_split_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_ep_split_LDADD = $(TEST_ENGINE_LIBS)
check_PROGRAMS += tests/unit/test_cpu_linear tests/unit/test_cpu_indexer
TESTS += tests/unit/test_cpu_linear tests/unit/test_cpu_indexer
tests_unit_test_cpu_linear_SOURCES = tests/unit/test_cpu_linear.c
tests_unit_test_cpu_linear_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_linear_LDADD = $(TEST_ENGINE_LIBS)
tests_unit_test_cpu_indexer_SOURCES = tests/unit/test_cpu_indexer.c
tests_unit_test_cpu_indexer_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_indexer_LDADD = $(TEST_ENGINE_LIBS)

# The CUDA kernels' CPU twins (cpu_twin_cuda.h says what each is the reference for): plain C, built for
# the tests only (TEST_ENGINE_LIBS links them), so CI compiles them without a GPU and dsv4d never
# carries them.
check_LTLIBRARIES += libdsv4twin.la
libdsv4twin_la_SOURCES = engine/cpu/cpu_twin_cuda.c engine/cpu/cpu_twin_cuda.h
check_PROGRAMS += tests/unit/test_cpu_twin
TESTS += tests/unit/test_cpu_twin
tests_unit_test_cpu_twin_SOURCES = tests/unit/test_cpu_twin.c tests/unit/seed_util.h
tests_unit_test_cpu_twin_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_twin_LDADD = $(TEST_ENGINE_LIBS)
