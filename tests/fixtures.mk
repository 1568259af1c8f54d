# tests/fixtures/: tiny random DeepSeek-V4 models and transformers' logits for them (the CPU backend's
# oracle), and the script that makes them. The directory ships whole so `make distcheck` can run the
# tests from the tarball; models/local.mk ships and installs models/default.
EXTRA_DIST += tests/fixtures tools/mkfixtures.py
