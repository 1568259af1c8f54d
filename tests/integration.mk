# SPDX-License-Identifier: MIT
# tests/integration: dsv4d end to end on the CPU backend with a fixture model. The Python tests speak
# the protocol with the PyPI msgpack package (tests/integration/dsv4d_harness.py starts the daemon
# under systemd-socket-activate or with --listen and follows its sd_notify messages); they print TAP.
DSV4D_INTEGRATION_TESTS = \
	tests/integration/test_dsv4d_lifecycle.py \
	tests/integration/test_dsv4d_protocol.py \
	tests/integration/test_dsv4d_hostile.py \
	tests/integration/test_dsv4d_client.py \
	tests/integration/test_dsv4ctl_bench.py \
	tests/integration/test_dsv4d_soak.py \
	tests/integration/test_synthetic.py \
	tests/integration/test_units.sh \
	tests/integration/test_docs.sh
TESTS += $(DSV4D_INTEGRATION_TESTS)
EXTRA_DIST += $(DSV4D_INTEGRATION_TESTS) tests/integration/dsv4d_harness.py
# They run the programs under test from the build tree (make check builds them first: dsv4d,
# dsv4-run and dsv4ctl are in all, the checker in check_PROGRAMS). test_units.sh runs
# `systemd-analyze verify` and `systemd-analyze security --offline=true` on units/ as CI does, and
# make install and uninstall into a DESTDIR of its own.

# libdsv4client's checks against a live daemon; test_dsv4d_client.py starts the daemon and runs it.
check_PROGRAMS += tests/integration/dsv4d_client_check
tests_integration_dsv4d_client_check_SOURCES = tests/integration/dsv4d_client_check.c
tests_integration_dsv4d_client_check_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS)
tests_integration_dsv4d_client_check_LDADD = libdsv4client.la $(CMOCKA_LIBS)

# dsv4d's settings (config file and flags), a unit test of daemon/settings.c.
check_PROGRAMS += tests/unit/test_daemon_settings
TESTS += tests/unit/test_daemon_settings
tests_unit_test_daemon_settings_SOURCES = tests/unit/test_daemon_settings.c daemon/settings.c daemon/log.c
tests_unit_test_daemon_settings_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_daemon_settings_LDADD = $(TEST_ENGINE_LIBS)
