# engine/tokenizer.mk: byte-level BPE tokenizer (Hugging Face tokenizer.json) and the V4 chat format.
libdsv4engine_la_SOURCES += engine/tokenizer.c engine/tokenizer.h engine/tok_internal.h \
	engine/tok_unicode.c
