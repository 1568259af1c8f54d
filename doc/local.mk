# SPDX-License-Identifier: MIT
# doc/: the model and protocol descriptions and the man pages, installed by `make install`.
dist_doc_DATA = doc/PROTOCOL.md doc/MODEL.md LICENSE

# Section 1: user commands.
dist_man1_MANS = doc/dsv4ctl.1

# Section 8: daemons.
dist_man8_MANS = doc/dsv4d.8

if HAVE_OPENAI
dist_man8_MANS += doc/dsv4-openai.8
else
EXTRA_DIST += doc/dsv4-openai.8
endif
