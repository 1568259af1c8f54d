# SPDX-License-Identifier: MIT
# tools/: dsv4-run (offline engine), dsv4-bench, checkpoint makers, fixture scripts.
bin_PROGRAMS += dsv4-run
dsv4_run_SOURCES = tools/dsv4-run.c tools/run.h
dsv4_run_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS)
dsv4_run_LDADD = libdsv4engine.la
# The README's first command (build, serve models/default, ask it), and speculation measured through dsv4d.
dist_noinst_SCRIPTS += tools/serve-default.sh tools/measure-spec.sh
# Step latency with a long prompt arriving while others decode (CPU backend); not installed.
noinst_PROGRAMS += dsv4-sched-bench
dsv4_sched_bench_SOURCES = tools/dsv4-sched-bench.c
dsv4_sched_bench_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
dsv4_sched_bench_LDADD = libdsv4engine.la
include $(srcdir)/tools/run_model.mk
include $(srcdir)/tools/run_tokenizer.mk
# dsv4-bench's floor (tools/bench_floor.h), checked without a GPU.
check_PROGRAMS += tests/unit/test_bench_floor
TESTS += tests/unit/test_bench_floor
tests_unit_test_bench_floor_SOURCES = tests/unit/test_bench_floor.c tools/bench_floor.h
tests_unit_test_bench_floor_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_bench_floor_LDADD = $(TEST_ENGINE_LIBS) -lm
