# SPDX-License-Identifier: MIT
# units/: systemd units, sysusers/tmpfiles snippets and the default config, installed by make install.
sysusersdir = $(prefix)/lib/sysusers.d
tmpfilesdir = $(prefix)/lib/tmpfiles.d
dsv4dconfdir = $(sysconfdir)/dsv4d

systemdsystemunit_DATA = units/dsv4d.socket units/dsv4d.service
sysusers_DATA = units/sysusers.d/dsv4d.conf
tmpfiles_DATA = units/tmpfiles.d/dsv4d.conf
dsv4dconf_DATA = units/dsv4d.conf
EXTRA_DIST += units/dsv4d.socket units/dsv4d.service.in units/dsv4d.conf.in \
	units/sysusers.d/dsv4d.conf units/tmpfiles.d/dsv4d.conf
CLEANFILES += units/dsv4d.service units/dsv4d.conf

# Paths the units and the config name are the configured ones.
units/dsv4d.service: units/dsv4d.service.in Makefile
units/dsv4d.conf: units/dsv4d.conf.in Makefile
units/dsv4d.service units/dsv4d.conf:
	$(AM_V_GEN)$(MKDIR_P) units && sed -e 's|@sbindir[@]|$(sbindir)|g' -e 's|@sysconfdir[@]|$(sysconfdir)|g' \
		-e 's|@pkgdatadir[@]|$(pkgdatadir)|g' $(srcdir)/$@.in > $@.tmp && mv $@.tmp $@

# dsv4-openai's units, when it is built.
if HAVE_OPENAI
systemdsystemunit_DATA += units/dsv4-openai.socket units/dsv4-openai.service
CLEANFILES += units/dsv4-openai.service
endif
EXTRA_DIST += units/dsv4-openai.socket units/dsv4-openai.service.in
units/dsv4-openai.service: units/dsv4-openai.service.in Makefile
	$(AM_V_GEN)$(MKDIR_P) units && sed -e 's|@bindir[@]|$(bindir)|g' $(srcdir)/$@.in > $@.tmp && mv $@.tmp $@
