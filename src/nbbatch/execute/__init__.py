"""Execute: one attempt of one run, the same on every backend (``nbbatch run-one``): papermill's engine,
kernels, the watchdog, GPU telemetry and slots, and the framework environments the kernels live in.

Nothing is imported here: papermill's entry-point scan imports :mod:`nbbatch.execute.engine`, which must stay light.
"""
