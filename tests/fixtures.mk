# SPDX-License-Identifier: MIT
# tests/fixtures/: tiny random DeepSeek-V4 models and transformers' logits for them (the CPU backend's
# oracle), and the script that makes them. The directory ships whole so `make distcheck` can run the
# tests from the tarball; models/local.mk ships and installs models/default.
EXTRA_DIST += tests/fixtures tools/mkfixtures.py

# The oracle: every case of every tests/fixtures/ model, exact numerics (fp8's deviation from them only
# reported; tests/fixtures_fp8.mk asserts fp8 against its own oracle). fixture_cases.{c,h}: shared by both.
check_PROGRAMS += tests/integration/test_fixtures
TESTS += tests/integration/test_fixtures
tests_integration_test_fixtures_SOURCES = tests/integration/test_fixtures.c \
	tests/integration/fixture_cases.c tests/integration/fixture_cases.h tools/greedy.h
tests_integration_test_fixtures_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_integration_test_fixtures_LDADD = $(TEST_ENGINE_LIBS)

# The MTP block against tools/mkfixtures_mtp.py's PyTorch oracle (tests/fixtures/*_mtp/), and speculative
# rows taken back bitwise (draft, verify, accept on the CPU sequence).
# tools/mtp_block.py is that oracle's MTP block (tools/train_default.py trains models/default's with it).
EXTRA_DIST += tools/mkfixtures_mtp.py tools/mtp_block.py
check_PROGRAMS += tests/integration/test_spec_cpu
TESTS += tests/integration/test_spec_cpu
tests_integration_test_spec_cpu_SOURCES = tests/integration/test_spec_cpu.c \
	tests/integration/fixture_cases.c tests/integration/fixture_cases.h tools/greedy.h
tests_integration_test_spec_cpu_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_integration_test_spec_cpu_LDADD = $(TEST_ENGINE_LIBS)
