"""Helpers shared by the tests, imported as ``from support.<module> import ...`` (pytest puts tests/ on sys.path
through ``pythonpath`` in pyproject.toml). tests/conftest.py holds only fixtures and hooks.

- :mod:`support.machine`: the repository root and what this machine has (GPUs, chromium).
- :mod:`support.notebooks`: tiny notebooks to run, and real papermill executions laid out like a share.
- :mod:`support.processes`: the kernel processes a test left behind.
- :mod:`support.shares`: the one share double (remote-looking, failing, counting).
- :mod:`support.waiting`: wait on a condition instead of sleeping a fixed time.
- :mod:`support.frameworks`: the ``framework_envs`` session fixture (framework venvs built once).
- :mod:`support.nvml`: a stand-in for ``pynvml``.
- :mod:`support.azure`: a toy project the azureml backend can plan for.
- :mod:`support.kubernetes`: Job and Pod manifests, and the ``Status`` of a refusal, for tests against the fake
  Kubernetes API server (tests/fakes/kubernetes_api.py).
"""
