# client/: fragment of the top Makefile.am
