# tools/: dsv4-run (offline engine), dsv4-bench, checkpoint makers, fixture scripts.
bin_PROGRAMS += dsv4-run
dsv4_run_SOURCES = tools/dsv4-run.c tools/run.h
dsv4_run_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS)
dsv4_run_LDADD = libdsv4engine.la
include $(srcdir)/tools/run_model.mk
include $(srcdir)/tools/run_tokenizer.mk
