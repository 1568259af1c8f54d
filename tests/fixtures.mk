# tests/fixtures/: tiny random DeepSeek-V4 models and transformers' logits for them (the CPU backend's
# oracle), and the script that makes them.  The directory ships whole so `make distcheck` can run the
# fixture tests from the tarball.
EXTRA_DIST += tests/fixtures tools/mkfixtures.py
