# tests/integration: dsv4d end to end on the CPU backend with a fixture model. The Python tests speak
# the protocol with the PyPI msgpack package (tests/integration/dsv4d_harness.py starts the daemon
# under systemd-socket-activate or with --listen and follows its sd_notify messages); they print TAP.
DSV4D_INTEGRATION_TESTS = \
	tests/integration/test_dsv4d_lifecycle.py \
	tests/integration/test_dsv4d_protocol.py \
	tests/integration/test_dsv4d_hostile.py
TESTS += $(DSV4D_INTEGRATION_TESTS)
EXTRA_DIST += $(DSV4D_INTEGRATION_TESTS) tests/integration/dsv4d_harness.py
# They run the programs under test from the build tree.
tests/integration/test_dsv4d_lifecycle.py.log tests/integration/test_dsv4d_protocol.py.log \
tests/integration/test_dsv4d_hostile.py.log: dsv4d$(EXEEXT) dsv4-run$(EXEEXT)
