# engine/tokenizer.mk
