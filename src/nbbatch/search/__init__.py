"""Searches: an experiment's ``search:`` run by a driver that asks Optuna for trials and prunes hopeless runs.

:mod:`nbbatch.search.study` is Optuna's side (the study, its journal, sampler and pruner); the loop that runs the
trials through the experiment's backend is a driver, :mod:`nbbatch.drivers.search`.
"""
