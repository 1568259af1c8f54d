# SPDX-License-Identifier: MIT
# base/: header-only pieces below every component (the protocol, the engine and the daemon may all
# include them; they include nothing of the project's).
noinst_HEADERS += base/utf8.h

check_PROGRAMS += tests/unit/test_utf8
TESTS += tests/unit/test_utf8
tests_unit_test_utf8_SOURCES = tests/unit/test_utf8.c tests/unit/seed_util.h
tests_unit_test_utf8_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS)
tests_unit_test_utf8_LDADD = $(CMOCKA_LIBS)
