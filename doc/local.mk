# SPDX-License-Identifier: MIT
# doc/: the model and protocol descriptions and the man pages, installed by `make install`.
dist_doc_DATA = doc/PROTOCOL.md doc/MODEL.md doc/MULTIGPU.md LICENSE

# Section 1: user commands.
dist_man1_MANS = doc/dsv4ctl.1

# Section 8: daemons. dsv4d.8 names the configured sysconfdir, as the binary and the units do.
man8_MANS = doc/dsv4d.8
EXTRA_DIST += doc/dsv4d.8.in
CLEANFILES += doc/dsv4d.8
doc/dsv4d.8: doc/dsv4d.8.in Makefile
	$(AM_V_GEN)$(MKDIR_P) doc && sed -e 's|@sysconfdir[@]|$(sysconfdir)|g' $(srcdir)/doc/dsv4d.8.in > $@.tmp && \
		mv $@.tmp $@

if HAVE_OPENAI
dist_man8_MANS = doc/dsv4-openai.8
else
EXTRA_DIST += doc/dsv4-openai.8
endif
