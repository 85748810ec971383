"""Spec: what to run. An experiment (frameworks and/or notebooks × a sweep, resources, backend, share),
the framework data it names, and the project it lives in; :mod:`nbbatch.spec.schema` publishes its JSON Schema."""

from nbbatch.spec.experiment import Experiment, NotebookEntry, load_experiment

__all__ = ["Experiment", "NotebookEntry", "load_experiment"]
