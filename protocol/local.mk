# protocol/: fragment of the top Makefile.am
