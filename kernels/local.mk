# kernels/: fragment of the top Makefile.am
