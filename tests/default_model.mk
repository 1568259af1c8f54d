# SPDX-License-Identifier: MIT
# The shipped default model end to end: tests/integration/test_default_model.py asks dsv4d (CPU
# backend, temperature 0) a fixed list of questions on models/default (BF16) and models/default-fp8
# (the same weights in DeepSeek's FP8/FP4 release format, made by tools/convert_release.py) and
# checks the headline answers, measured accuracy floors and agreement with transformers' replies.
TESTS += tests/integration/test_default_model.py
EXTRA_DIST += tests/integration/test_default_model.py models/default-fp8 tools/convert_release.py
