# SPDX-License-Identifier: MIT
# openai/: dsv4-openai, the OpenAI-compatible HTTP front, a separate daemon over libdsv4client.
# The V4 chat format and reply parsing are a library of their own so the unit test links them alone.
noinst_LTLIBRARIES += libdsv4openai.la
libdsv4openai_la_SOURCES = openai/buf.c openai/buf.h openai/pyjson.c openai/pyjson.h \
	openai/render.c openai/render.h openai/reply.c openai/reply.h
libdsv4openai_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
libdsv4openai_la_LIBADD = $(JANSSON_LIBS) -lm

check_PROGRAMS += tests/unit/test_openai_format
TESTS += tests/unit/test_openai_format
tests_unit_test_openai_format_SOURCES = tests/unit/test_openai_format.c
tests_unit_test_openai_format_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(JANSSON_CFLAGS)
tests_unit_test_openai_format_LDADD = libdsv4openai.la $(CMOCKA_LIBS) $(JANSSON_LIBS)
EXTRA_DIST += tests/fixtures/openai/dsml.json tools/make_openai_fixtures.py

if HAVE_OPENAI
bin_PROGRAMS += dsv4-openai
dsv4_openai_SOURCES = openai/main.c openai/http.c openai/http.h openai/job.c openai/job.h openai/job_internal.h openai/job_respond.c openai/job_dsv4d.c \
	openai/job_fields.c openai/job_generate.c openai/job_info.c openai/log.c openai/log.h \
	openai/server.h
dsv4_openai_CFLAGS = $(AM_CFLAGS) $(MHD_CFLAGS) $(JANSSON_CFLAGS) $(SYSTEMD_CFLAGS)
dsv4_openai_LDADD = libdsv4openai.la libdsv4client.la $(MHD_LIBS) $(JANSSON_LIBS) $(SYSTEMD_LIBS) -lm
endif

# End to end with the openai package (tests/integration/test_openai.py skips when dsv4-openai was not built).
TESTS += tests/integration/test_openai.py tests/integration/test_openai_hostile.py
EXTRA_DIST += tests/integration/test_openai.py tests/integration/test_openai_hostile.py tests/integration/openai_harness.py
