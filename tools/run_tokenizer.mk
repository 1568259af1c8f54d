# SPDX-License-Identifier: MIT
# tools/run_tokenizer.c: dsv4-run --tokenizer
dsv4_run_SOURCES += tools/run_tokenizer.c
