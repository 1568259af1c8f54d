# SPDX-License-Identifier: MIT
# models/: the embedded default model, installed where units/dsv4d.conf points (pkgdatadir/models/default).
defaultmodeldir = $(pkgdatadir)/models/default
dist_defaultmodel_DATA = \
	models/default/config.json \
	models/default/generation_config.json \
	models/default/model.safetensors \
	models/default/tokenizer.json \
	models/default/README.md
# The whole directory ships (training log and evaluation too) so the tests run from the tarball.
EXTRA_DIST += models/default tools/train_default.py
