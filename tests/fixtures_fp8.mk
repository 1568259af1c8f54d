# SPDX-License-Identifier: MIT
# The CPU backend's fp8 (official) numerics against tools/mkfixtures_fp8.py's oracle: transformers'
# deepseek_v4 with the official cache roundings, cases_fp8.json + *.fp8.f32 beside each fixture model
# (tests/fixtures/README_fp8.md). The data ships with tests/fixtures (tests/fixtures.mk).
check_PROGRAMS += tests/integration/test_fixtures_fp8
TESTS += tests/integration/test_fixtures_fp8
tests_integration_test_fixtures_fp8_SOURCES = tests/integration/test_fixtures_fp8.c \
	tests/integration/fixture_cases.c tests/integration/fixture_cases.h tools/greedy.h
tests_integration_test_fixtures_fp8_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_integration_test_fixtures_fp8_LDADD = $(TEST_ENGINE_LIBS)
EXTRA_DIST += tools/mkfixtures_fp8.py
