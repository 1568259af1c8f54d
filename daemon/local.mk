# daemon/: fragment of the top Makefile.am
