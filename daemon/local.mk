# SPDX-License-Identifier: MIT
# daemon/: dsv4d. main (settings, startup), log, settings, listen (sockets), notify (sd_notify),
# reqmem (jemalloc request arena), host (engine thread), server (sd-event loop, lifecycle),
# conn (connections, frames, bounded buffers), dispatch (methods, engine events), prompts (the
# thread that tokenizes large prompts), fault (a test switch that fails the backend as a faulted GPU).
sbin_PROGRAMS += dsv4d
dsv4d_SOURCES = daemon/main.c \
	daemon/log.c daemon/log.h \
	daemon/settings.c daemon/settings.h \
	daemon/listen.c daemon/listen.h \
	daemon/notify.c daemon/notify.h \
	daemon/reqmem.c daemon/reqmem.h \
	daemon/host.c daemon/host.h \
	daemon/server.c daemon/server.h daemon/lifecycle.h daemon/clock.h \
	daemon/conn.c daemon/conn.h \
	daemon/prompts.c daemon/prompts.h \
	daemon/fault.c daemon/fault.h \
	daemon/dispatch.c daemon/dispatch.h
dsv4d_CPPFLAGS = $(AM_CPPFLAGS) -DDSV4D_CONFIG_PATH='"$(sysconfdir)/dsv4d/dsv4d.conf"'
dsv4d_CFLAGS = $(AM_CFLAGS) $(SYSTEMD_CFLAGS) $(PROTOCOL_CFLAGS) $(JEMALLOC_CFLAGS) $(JANSSON_CFLAGS) $(ONIG_CFLAGS) \
	$(DSV4_CUDA_CPPFLAGS)
dsv4d_LDADD = $(PROTOCOL_LIBS) libdsv4engine.la $(DSV4_CUDA_LDADD) $(SYSTEMD_LIBS) $(JEMALLOC_LIBS)
