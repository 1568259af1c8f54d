# SPDX-License-Identifier: MIT
# client/: libdsv4client (public header dsv4client.h, pkg-config dsv4client) and dsv4ctl.
lib_LTLIBRARIES += libdsv4client.la
libdsv4client_la_SOURCES = client/client.c client/dsv4client.h
libdsv4client_la_CFLAGS = $(AM_CFLAGS) $(PROTOCOL_CFLAGS)
libdsv4client_la_LIBADD = libdsv4protocol.la $(MSGPACK_LIBS)
# current:revision:age with age 0: every ABI change is a new soname, libdsv4client.so.$(DSV4CLIENT_ABI)
# (client/dsv4client.h says why); only dsv4_client_* is exported, the protocol code stays private
libdsv4client_la_LDFLAGS = -version-info $(DSV4CLIENT_ABI):0:0 -export-symbols-regex '^dsv4_client_'
include_HEADERS += client/dsv4client.h
pkgconfigdir = $(libdir)/pkgconfig
pkgconfig_DATA = client/dsv4client.pc
EXTRA_DIST += client/dsv4client.pc.in

bin_PROGRAMS += dsv4ctl
dsv4ctl_SOURCES = client/dsv4ctl.c client/ctl_bench.c client/ctl_bench.h
dsv4ctl_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
dsv4ctl_LDADD = libdsv4client.la $(JANSSON_LIBS) -lm

check_PROGRAMS += tests/unit/test_client
TESTS += tests/unit/test_client
tests_unit_test_client_SOURCES = tests/unit/test_client.c tests/unit/proto_test_util.h
tests_unit_test_client_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(PROTOCOL_CFLAGS)
tests_unit_test_client_LDADD = libdsv4client.la $(PROTOCOL_LIBS) $(CMOCKA_LIBS)

# The ABI: struct layouts recorded per DSV4_CLIENT_ABI, and the soname.
check_PROGRAMS += tests/unit/test_client_abi
TESTS += tests/unit/test_client_abi
tests_unit_test_client_abi_SOURCES = tests/unit/test_client_abi.c
tests_unit_test_client_abi_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS)
tests_unit_test_client_abi_LDADD = $(CMOCKA_LIBS)

# dsv4ctl itself (the built program, run from $(top_builddir)) against a scripted fake server.
check_PROGRAMS += tests/unit/test_client_ctl
TESTS += tests/unit/test_client_ctl
tests_unit_test_client_ctl_SOURCES = tests/unit/test_client_ctl.c tests/unit/proto_test_util.h
tests_unit_test_client_ctl_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(PROTOCOL_CFLAGS) $(JANSSON_CFLAGS)
tests_unit_test_client_ctl_LDADD = $(PROTOCOL_LIBS) $(CMOCKA_LIBS) $(JANSSON_LIBS)
