# SPDX-License-Identifier: MIT
# tools/: dsv4-run (offline engine), dsv4-bench, checkpoint makers, fixture scripts.
bin_PROGRAMS += dsv4-run
dsv4_run_SOURCES = tools/dsv4-run.c tools/run.h
dsv4_run_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS)
dsv4_run_LDADD = libdsv4engine.la
# Step latency with a long prompt arriving while others decode (CPU backend); not installed.
noinst_PROGRAMS += dsv4-sched-bench
dsv4_sched_bench_SOURCES = tools/dsv4-sched-bench.c
dsv4_sched_bench_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
dsv4_sched_bench_LDADD = libdsv4engine.la
include $(srcdir)/tools/run_model.mk
include $(srcdir)/tools/run_tokenizer.mk
