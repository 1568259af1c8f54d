# tests/fixtures/: tiny random DeepSeek-V4 models and transformers' logits for them (the CPU backend's
# oracle), and the script that makes them.  models/default/: the trained default model, which the
# integration tests talk to, and its training script.  The directories ship whole so `make distcheck`
# can run the tests from the tarball.
EXTRA_DIST += tests/fixtures tools/mkfixtures.py models/default tools/train_default.py
