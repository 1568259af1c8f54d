# SPDX-License-Identifier: MIT
# doc/: the model and protocol descriptions and the man pages, installed by `make install`. The pages
# are made from their .in files with this build's version and paths (dsv4d.8 names the configured
# sysconfdir, as the binary and the units do).
dist_doc_DATA = doc/PROTOCOL.md doc/MODEL.md doc/MULTIGPU.md LICENSE

# Section 1: user commands; section 8: daemons.
man1_MANS = doc/dsv4ctl.1 doc/dsv4-run.1
man8_MANS = doc/dsv4d.8
MAN_PAGES_IN = doc/dsv4ctl.1.in doc/dsv4-run.1.in doc/dsv4d.8.in doc/dsv4-openai.8.in
EXTRA_DIST += $(MAN_PAGES_IN)
CLEANFILES += $(MAN_PAGES_IN:.in=)
if HAVE_OPENAI
man8_MANS += doc/dsv4-openai.8
endif

edit_man = sed -e 's|@sysconfdir[@]|$(sysconfdir)|g' -e 's|@pkgdatadir[@]|$(pkgdatadir)|g' \
	-e 's|@PACKAGE_VERSION[@]|$(PACKAGE_VERSION)|g'
$(MAN_PAGES_IN:.in=): Makefile
	$(AM_V_GEN)$(MKDIR_P) doc && $(edit_man) $(srcdir)/$@.in > $@.tmp && mv $@.tmp $@
doc/dsv4ctl.1: doc/dsv4ctl.1.in
doc/dsv4-run.1: doc/dsv4-run.1.in
doc/dsv4d.8: doc/dsv4d.8.in
doc/dsv4-openai.8: doc/dsv4-openai.8.in
