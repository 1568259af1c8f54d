# SPDX-License-Identifier: MIT
# engine/serve/: scheduler (continuous batching), sampler, Philox RNG, prefix cache and their tests.
libdsv4engine_la_SOURCES += \
	engine/serve/philox.c engine/serve/philox.h \
	engine/serve/sampler.c engine/serve/sampler.h \
	engine/serve/scheduler.c engine/serve/scheduler.h engine/serve/sched_internal.h \
	engine/serve/sched_step.c engine/serve/sched_spec.c engine/serve/sched_prefix.c \
	engine/serve/sched_pool.c engine/serve/sched_emit.c \
	engine/serve/prefix_cache.c engine/serve/prefix_cache.h

check_PROGRAMS += tests/unit/test_prefix_cache
TESTS += tests/unit/test_prefix_cache
tests_unit_test_prefix_cache_SOURCES = tests/unit/test_prefix_cache.c
tests_unit_test_prefix_cache_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_prefix_cache_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_sampler
TESTS += tests/unit/test_sampler
tests_unit_test_sampler_SOURCES = tests/unit/test_sampler.c
tests_unit_test_sampler_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_sampler_LDADD = $(TEST_ENGINE_LIBS)

check_PROGRAMS += tests/unit/test_scheduler
TESTS += tests/unit/test_scheduler
tests_unit_test_scheduler_SOURCES = tests/unit/test_scheduler.c tests/unit/fake_backend.c tests/unit/fake_backend.h
tests_unit_test_scheduler_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_scheduler_LDADD = $(TEST_ENGINE_LIBS) $(JANSSON_LIBS)
# Count allocations made inside scheduler calls (see the test's __wrap_ functions).
tests_unit_test_scheduler_LDFLAGS = -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc

# The scheduler over the real CPU backend on the tiny fixture models.
check_PROGRAMS += tests/unit/test_sched_cpu
TESTS += tests/unit/test_sched_cpu
tests_unit_test_sched_cpu_SOURCES = tests/unit/test_sched_cpu.c tests/unit/sched_harness.h tests/unit/fixture_cases.h
tests_unit_test_sched_cpu_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_sched_cpu_LDADD = $(TEST_ENGINE_LIBS) $(JANSSON_LIBS)
check_PROGRAMS += tests/unit/test_sched_spec
TESTS += tests/unit/test_sched_spec
tests_unit_test_sched_spec_SOURCES = tests/unit/test_sched_spec.c tests/unit/sched_harness.h tests/unit/fixture_cases.h
tests_unit_test_sched_spec_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_sched_spec_LDADD = $(TEST_ENGINE_LIBS) $(JANSSON_LIBS)

# The prefix cache over the CPU backend: cached requests against cold ones, bit for bit.
check_PROGRAMS += tests/unit/test_prefix_cpu
TESTS += tests/unit/test_prefix_cpu
tests_unit_test_prefix_cpu_SOURCES = tests/unit/test_prefix_cpu.c tests/unit/sched_harness.h tests/unit/prefix_util.h
tests_unit_test_prefix_cpu_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_prefix_cpu_LDADD = $(TEST_ENGINE_LIBS)
