# SPDX-License-Identifier: MIT
# tools/run_model.c: dsv4-run --model
dsv4_run_SOURCES += tools/run_model.c tools/greedy.h
# The command-line contract, end to end on the tiny_a fixture.
TESTS += tests/integration/test_run_model.sh
EXTRA_DIST += tests/integration/test_run_model.sh
