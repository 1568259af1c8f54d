# engine/cpu.mk: the CPU reference backend (forward pass, per-sequence caches, backend ops).
libdsv4engine_la_SOURCES += \
	engine/cpu_forward.c engine/cpu_forward.h engine/cpu_ops.h \
	engine/cpu_ops.c engine/cpu_rope.c engine/cpu_mhc.c \
	engine/cpu_compressor.c engine/cpu_indexer.c engine/cpu_attention.c \
	engine/cpu_moe.c engine/cpu_pool.c engine/cpu_backend.c engine/cpu_prefix.c

# The oracle: every case of every tests/fixtures/ model, exact numerics (fp8's deviation from them only
# reported; tests/fixtures_fp8.mk asserts fp8 against its own oracle). fixture_cases.{c,h}: shared by both.
check_PROGRAMS += tests/integration/test_fixtures
TESTS += tests/integration/test_fixtures
tests_integration_test_fixtures_SOURCES = tests/integration/test_fixtures.c \
	tests/integration/fixture_cases.c tests/integration/fixture_cases.h tools/greedy.h
tests_integration_test_fixtures_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_integration_test_fixtures_LDADD = $(TEST_ENGINE_LIBS)

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
check_PROGRAMS += tests/unit/test_cpu_linear tests/unit/test_cpu_indexer
TESTS += tests/unit/test_cpu_linear tests/unit/test_cpu_indexer
tests_unit_test_cpu_linear_SOURCES = tests/unit/test_cpu_linear.c
tests_unit_test_cpu_linear_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_linear_LDADD = $(TEST_ENGINE_LIBS)
tests_unit_test_cpu_indexer_SOURCES = tests/unit/test_cpu_indexer.c
tests_unit_test_cpu_indexer_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_cpu_indexer_LDADD = $(TEST_ENGINE_LIBS)
