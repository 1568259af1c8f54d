# engine/: model config, loader, tokenizer, chat format, CPU reference backend, scheduler, sampler.
# Each module group keeps its sources and tests in its own fragment.
noinst_LTLIBRARIES += libdsv4engine.la
libdsv4engine_la_SOURCES = engine/error.c engine/error.h engine/backend.h
libdsv4engine_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS)
libdsv4engine_la_LIBADD = $(JANSSON_LIBS) $(ONIG_LIBS) -lm

# Tests link the engine and cmocka.
TEST_ENGINE_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(JANSSON_CFLAGS)
TEST_ENGINE_LIBS = libdsv4engine.la $(CMOCKA_LIBS)

include $(srcdir)/engine/loader.mk
include $(srcdir)/engine/cpu.mk
include $(srcdir)/engine/tokenizer.mk
include $(srcdir)/engine/serving.mk
