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
	protocol/wire.c protocol/wire.h
libdsv4protocol_la_CFLAGS = $(AM_CFLAGS) $(MSGPACK_CFLAGS)
libdsv4protocol_la_LIBADD = $(MSGPACK_LIBS) -lm
