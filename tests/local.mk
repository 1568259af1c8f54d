# SPDX-License-Identifier: MIT
# tests/: unit tests live beside their module's fragment; this holds the shared pieces.
check_PROGRAMS += tests/unit/test_error
TESTS += tests/unit/test_error
tests_unit_test_error_SOURCES = tests/unit/test_error.c
tests_unit_test_error_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_error_LDADD = $(TEST_ENGINE_LIBS)
check_PROGRAMS += tests/unit/test_workpool
TESTS += tests/unit/test_workpool
tests_unit_test_workpool_SOURCES = tests/unit/test_workpool.c
tests_unit_test_workpool_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_workpool_LDADD = $(TEST_ENGINE_LIBS)
include $(srcdir)/tests/fixtures.mk
include $(srcdir)/tests/integration.mk
include $(srcdir)/tests/fixtures_fp8.mk
include $(srcdir)/tests/default_model.mk
include $(srcdir)/tests/fuzz.mk
EXTRA_DIST += tests/README.md

# Dependencies point one way: includes per folder, and no circle of calls between files (nm).
TESTS += tests/test_layering.py
EXTRA_DIST += tests/test_layering.py
