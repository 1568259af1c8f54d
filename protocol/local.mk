# protocol/: frames, pre-validation, msgpack-rpc messages, error codes (doc/PROTOCOL.md).
# Users (client, daemon, tests) compile with $(PROTOCOL_CFLAGS) and link $(PROTOCOL_LIBS).
PROTOCOL_CFLAGS = $(MSGPACK_CFLAGS)
PROTOCOL_LIBS = libdsv4protocol.la $(MSGPACK_LIBS)
noinst_HEADERS += protocol/codes.h protocol/frame.h protocol/validate.h protocol/message.h
