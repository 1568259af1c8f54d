# SPDX-License-Identifier: MIT
# units/: systemd units, sysusers/tmpfiles snippets and the default config, installed by make install.
sysusersdir = $(prefix)/lib/sysusers.d
tmpfilesdir = $(prefix)/lib/tmpfiles.d
dsv4dconfdir = $(sysconfdir)/dsv4d

systemdsystemunit_DATA = units/dsv4d.socket units/dsv4d.service
sysusers_DATA = units/sysusers.d/dsv4d.conf
tmpfiles_DATA = units/tmpfiles.d/dsv4d.conf
noinst_DATA += units/dsv4d.conf
EXTRA_DIST += units/dsv4d.socket units/dsv4d.service.in units/dsv4d.conf.in \
	units/sysusers.d/dsv4d.conf units/tmpfiles.d/dsv4d.conf
CLEANFILES += units/dsv4d.service units/dsv4d.conf

# Paths the units and the config name are the configured ones.
units/dsv4d.service: units/dsv4d.service.in Makefile
units/dsv4d.conf: units/dsv4d.conf.in Makefile
units/dsv4d.service units/dsv4d.conf:
	$(AM_V_GEN)$(MKDIR_P) units && sed -e 's|@sbindir[@]|$(sbindir)|g' -e 's|@sysconfdir[@]|$(sysconfdir)|g' \
		-e 's|@pkgdatadir[@]|$(pkgdatadir)|g' $(srcdir)/$@.in > $@.tmp && mv $@.tmp $@

# dsv4d.conf is the operator's once installed (README: edit it): make install puts the shipped one there
# only when none is or it is unchanged, and otherwise beside it as dsv4d.conf.new, so an upgrade keeps
# the model and settings chosen; make uninstall removes it only while it is the shipped one (made again
# for the comparison when make clean has removed it).
install-data-local: units/dsv4d.conf
	@$(MKDIR_P) '$(DESTDIR)$(dsv4dconfdir)'
	@conf='$(DESTDIR)$(dsv4dconfdir)/dsv4d.conf'; \
	if test -f "$$conf" && ! cmp -s units/dsv4d.conf "$$conf"; then \
	  echo " keeping the edited $$conf; the shipped one is $$conf.new"; \
	  $(INSTALL_DATA) units/dsv4d.conf "$$conf.new"; \
	else \
	  echo " $(INSTALL_DATA) units/dsv4d.conf '$$conf'"; \
	  $(INSTALL_DATA) units/dsv4d.conf "$$conf"; \
	fi
uninstall-local: units/dsv4d.conf
	@conf='$(DESTDIR)$(dsv4dconfdir)/dsv4d.conf'; \
	rm -f "$$conf.new"; \
	if cmp -s units/dsv4d.conf "$$conf"; then \
	  rm -f "$$conf"; \
	elif test -f "$$conf"; then \
	  echo " keeping the edited $$conf"; \
	fi

# dsv4-openai's units, when it is built.
if HAVE_OPENAI
systemdsystemunit_DATA += units/dsv4-openai.socket units/dsv4-openai.service
CLEANFILES += units/dsv4-openai.service
endif
EXTRA_DIST += units/dsv4-openai.socket units/dsv4-openai.service.in
units/dsv4-openai.service: units/dsv4-openai.service.in Makefile
	$(AM_V_GEN)$(MKDIR_P) units && sed -e 's|@bindir[@]|$(bindir)|g' $(srcdir)/$@.in > $@.tmp && mv $@.tmp $@
