# SPDX-License-Identifier: MIT
# protocol/: frames, pre-validation, msgpack-rpc messages, error codes (doc/PROTOCOL.md).
# Users (client, daemon, tests) compile with $(PROTOCOL_CFLAGS) and link $(PROTOCOL_LIBS).
PROTOCOL_CFLAGS = $(MSGPACK_CFLAGS)
PROTOCOL_LIBS = libdsv4protocol.la $(MSGPACK_LIBS)

noinst_LTLIBRARIES += libdsv4protocol.la
libdsv4protocol_la_SOURCES = \
	protocol/codes.c protocol/codes.h \
	protocol/frame.c protocol/frame.h \
	protocol/validate.c protocol/validate.h \
	protocol/message.c protocol/message.h \
	protocol/generate.c \
	protocol/wire.c protocol/wire.h \
	protocol/message_codec.h
libdsv4protocol_la_CFLAGS = $(AM_CFLAGS) $(MSGPACK_CFLAGS)
libdsv4protocol_la_LIBADD = $(MSGPACK_LIBS) -lm

check_PROGRAMS += tests/unit/test_protocol
TESTS += tests/unit/test_protocol
tests_unit_test_protocol_SOURCES = tests/unit/test_protocol.c
tests_unit_test_protocol_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(PROTOCOL_CFLAGS)
tests_unit_test_protocol_LDADD = $(PROTOCOL_LIBS) $(CMOCKA_LIBS) -lm

check_PROGRAMS += tests/unit/test_protocol_hostile
TESTS += tests/unit/test_protocol_hostile
tests_unit_test_protocol_hostile_SOURCES = tests/unit/test_protocol_hostile.c
tests_unit_test_protocol_hostile_CFLAGS = $(AM_CFLAGS) $(CMOCKA_CFLAGS) $(PROTOCOL_CFLAGS)
tests_unit_test_protocol_hostile_LDADD = $(PROTOCOL_LIBS) $(CMOCKA_LIBS) -lm
