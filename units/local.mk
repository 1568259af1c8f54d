# units/: fragment of the top Makefile.am
