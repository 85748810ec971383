"""Front ends: the ``nbbatch`` command line, terminal progress, and the Jupyter widgets."""
