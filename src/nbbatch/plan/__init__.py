"""Plan: the concrete runs of an experiment, each with a stable id, validated against each notebook's
``parameters`` cell before anything starts."""

from nbbatch.plan.runs import Plan, Run, plan, run_id_for

__all__ = ["Plan", "Run", "plan", "run_id_for"]
