# doc/: fragment of the top Makefile.am
