# engine/cpu.mk: the CPU reference backend (forward pass, per-sequence caches, backend ops).
libdsv4engine_la_SOURCES += \
	engine/cpu_forward.c engine/cpu_forward.h engine/cpu_ops.h \
	engine/cpu_ops.c engine/cpu_rope.c engine/cpu_mhc.c \
	engine/cpu_compressor.c engine/cpu_indexer.c engine/cpu_attention.c \
	engine/cpu_moe.c engine/cpu_backend.c

# The oracle: every case of every tests/fixtures/ model, exact and fp8 numerics.
check_PROGRAMS += tests/integration/test_fixtures
TESTS += tests/integration/test_fixtures
tests_integration_test_fixtures_SOURCES = tests/integration/test_fixtures.c
tests_integration_test_fixtures_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_integration_test_fixtures_LDADD = $(TEST_ENGINE_LIBS)
