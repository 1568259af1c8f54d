# SPDX-License-Identifier: MIT
# engine/: backend.h (the seam between the scheduler and a backend), error.{c,h} (the per-thread
# error message every part uses) and workpool.{c,h} (the fork-join threads of the CPU backend and the
# scheduler's sampling) here; one folder per concern, each with its own fragment holding its
# sources and their unit tests: model/ (checkpoint and number formats), cpu/ (the reference backend),
# text/ (tokenizer, chat format), serve/ (scheduler, sampler, prefix cache).
noinst_LTLIBRARIES += libdsv4engine.la
libdsv4engine_la_SOURCES = engine/error.c engine/error.h engine/backend.h engine/workpool.c engine/workpool.h
libdsv4engine_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS)
libdsv4engine_la_LIBADD = $(JANSSON_LIBS) $(ONIG_LIBS) -lm

# Tests link the engine, the kernels' CPU twins (engine/cpu/local.mk: built for tests only) and cmocka.
TEST_ENGINE_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(JANSSON_CFLAGS)
TEST_ENGINE_LIBS = libdsv4twin.la libdsv4engine.la $(CMOCKA_LIBS)

include $(srcdir)/engine/model/local.mk
include $(srcdir)/engine/cpu/local.mk
include $(srcdir)/engine/text/local.mk
include $(srcdir)/engine/serve/local.mk
