# SPDX-License-Identifier: MIT
# tests/fuzz: libFuzzer targets, built with $(FUZZ_CC) (clang, found by configure or given with
# --enable-fuzz=CLANG) under ASan and UBSan from the sources they test, whatever compiler builds the
# rest. make check runs each for $(DSV4_FUZZ_SECONDS) over its committed seeds and regression inputs
# (tests/fuzz/corpus/TARGET); tests/fuzz/run_fuzz.sh says how to run one for longer.
FUZZ_FLAGS = -std=gnu11 -g -O1 $(WARN_CFLAGS) -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	-I$(top_srcdir) -I$(top_builddir)
FUZZ_PROTOCOL_FILES = tests/fuzz/fuzz_protocol.c protocol/frame.c protocol/validate.c protocol/message.c \
	protocol/generate.c protocol/wire.c protocol/codes.c
FUZZ_TEXT_FILES = engine/text/tokenizer.c engine/text/tok_unicode.c engine/text/chat.c engine/error.c
FUZZ_CONFIG_FILES = tests/fuzz/fuzz_config.c engine/model/config.c engine/error.c
FUZZ_SAFETENSORS_FILES = tests/fuzz/fuzz_safetensors.c engine/model/safetensors.c engine/error.c
FUZZ_OPENAI_FILES = tests/fuzz/fuzz_openai.c openai/render.c openai/reply.c openai/buf.c openai/pyjson.c
FUZZ_INCLUDES = base/utf8.h protocol/frame.h protocol/validate.h protocol/message.h protocol/wire.h protocol/codes.h \
	engine/text/tokenizer.h engine/text/tok_internal.h engine/text/chat.h engine/error.h engine/model/config.h \
	engine/model/safetensors.h openai/render.h openai/reply.h openai/buf.h openai/pyjson.h
EXTRA_DIST += tests/fuzz/fuzz_protocol.c tests/fuzz/fuzz_tokenizer.c tests/fuzz/fuzz_chat.c \
	tests/fuzz/fuzz_config.c tests/fuzz/fuzz_safetensors.c tests/fuzz/fuzz_openai.c tests/fuzz/corpus \
	tests/fuzz/README.md
TESTS += tests/fuzz/run_fuzz.sh
dist_noinst_SCRIPTS += tests/fuzz/run_fuzz.sh

if ENABLE_FUZZ
FUZZ_BINARIES = tests/fuzz/fuzz_protocol tests/fuzz/fuzz_tokenizer tests/fuzz/fuzz_chat tests/fuzz/fuzz_config \
	tests/fuzz/fuzz_safetensors tests/fuzz/fuzz_openai
check_DATA = $(FUZZ_BINARIES)
CLEANFILES += $(FUZZ_BINARIES)
fuzz: $(FUZZ_BINARIES)
tests/fuzz/fuzz_protocol: $(FUZZ_PROTOCOL_FILES) $(FUZZ_INCLUDES)
	@$(MKDIR_P) tests/fuzz
	$(AM_V_CCLD)$(FUZZ_CC) $(FUZZ_FLAGS) $(MSGPACK_CFLAGS) $(FUZZ_PROTOCOL_FILES:%=$(srcdir)/%) $(MSGPACK_LIBS) -o $@
tests/fuzz/fuzz_tokenizer: tests/fuzz/fuzz_tokenizer.c $(FUZZ_TEXT_FILES) $(FUZZ_INCLUDES)
	@$(MKDIR_P) tests/fuzz
	$(AM_V_CCLD)$(FUZZ_CC) $(FUZZ_FLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS) $(srcdir)/tests/fuzz/fuzz_tokenizer.c \
		$(FUZZ_TEXT_FILES:%=$(srcdir)/%) $(JANSSON_LIBS) $(ONIG_LIBS) -pthread -o $@
tests/fuzz/fuzz_chat: tests/fuzz/fuzz_chat.c $(FUZZ_TEXT_FILES) $(FUZZ_INCLUDES)
	@$(MKDIR_P) tests/fuzz
	$(AM_V_CCLD)$(FUZZ_CC) $(FUZZ_FLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS) $(srcdir)/tests/fuzz/fuzz_chat.c \
		$(FUZZ_TEXT_FILES:%=$(srcdir)/%) $(JANSSON_LIBS) $(ONIG_LIBS) -pthread -o $@
tests/fuzz/fuzz_config: $(FUZZ_CONFIG_FILES) $(FUZZ_INCLUDES)
	@$(MKDIR_P) tests/fuzz
	$(AM_V_CCLD)$(FUZZ_CC) $(FUZZ_FLAGS) $(JANSSON_CFLAGS) $(FUZZ_CONFIG_FILES:%=$(srcdir)/%) $(JANSSON_LIBS) -lm -o $@
tests/fuzz/fuzz_safetensors: $(FUZZ_SAFETENSORS_FILES) $(FUZZ_INCLUDES)
	@$(MKDIR_P) tests/fuzz
	$(AM_V_CCLD)$(FUZZ_CC) $(FUZZ_FLAGS) $(JANSSON_CFLAGS) $(FUZZ_SAFETENSORS_FILES:%=$(srcdir)/%) $(JANSSON_LIBS) -o $@
tests/fuzz/fuzz_openai: $(FUZZ_OPENAI_FILES) $(FUZZ_INCLUDES)
	@$(MKDIR_P) tests/fuzz
	$(AM_V_CCLD)$(FUZZ_CC) $(FUZZ_FLAGS) $(JANSSON_CFLAGS) $(FUZZ_OPENAI_FILES:%=$(srcdir)/%) $(JANSSON_LIBS) -lm -o $@
endif
# The targets grow their working corpora (one file per new input) in the build tree.
clean-local: clean-fuzz-corpus
clean-fuzz-corpus:
	-rm -rf tests/fuzz/work
.PHONY: fuzz clean-fuzz-corpus
