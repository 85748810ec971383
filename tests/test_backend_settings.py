"""Backend settings, declared once per backend as a frozen dataclass whose fields drive validation and the form."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from nbbatch.backends import Backend, Compute, SubmitOptions, backend_class, get_backend
from nbbatch.backends.local.backend import LocalBackend, LocalSettings
from nbbatch.backends.settings import Setting, setting, setting_table
from nbbatch.errors import BackendError


@dataclass(frozen=True)
class ToySettings:
    count: int | None = field(default=None, metadata=setting(minimum=1, label="count"))
    rate: float = field(default=0.5, metadata=setting(minimum=0))
    mode: str = field(default="a", metadata=setting(choices=("a", "b")))
    path: str | os.PathLike | None = None
    options: Mapping[str, str] | None = None
    flag: bool = False
    api_token: str | None = None
    client: Any = field(default=None, metadata=setting(python_only=True))


class ToyBackend(Backend):
    name: ClassVar[str] = "toy"
    Settings: ClassVar[type] = ToySettings
    settings_hint: ClassVar[str] = "see the toy docs"

    def compute(self) -> Compute:
        return Compute(self.name)

    def start(self, runs, share, options) -> None:
        return None


def test_the_table_comes_from_the_fields_annotations_defaults_and_metadata():
    table = setting_table(ToySettings)
    assert list(table) == [f.name for f in dataclasses.fields(ToySettings)]
    assert table["count"] == Setting(None, (int,), minimum=1, label="count")
    assert table["rate"] == Setting(0.5, (int, float), minimum=0)  # a float setting takes integers too
    assert table["mode"] == Setting("a", (str,), choices=("a", "b"))
    assert table["path"].kinds == (str, os.PathLike) and table["options"].kinds == (Mapping,)
    assert table["flag"] == Setting(False, (bool,))
    assert table["client"] == Setting(None, (), python_only=True)  # any object: tests pass doubles
    assert ToyBackend.form_settings() == {"count": table["count"]}


def test_a_backend_validates_its_settings_once_into_a_frozen_instance():
    backend = ToyBackend(count=2, rate=1)
    assert backend.settings == ToySettings(count=2, rate=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.settings.count = 3  # type: ignore[misc]
    again = ToyBackend(backend.settings, mode="b")  # an instance, with values by name replacing its own
    assert (again.settings.count, again.settings.mode) == (2, "b")
    client = object()
    assert ToyBackend(client=client).settings.client is client


@pytest.mark.parametrize("values, message", [
    ({"cont": 1}, r"unknown toy backend setting `cont` \(did you mean `count`\?\); known: count, rate, mode, path, "
                  r"options, flag, api_token; see the toy docs"),
    ({"count": 0}, r"toy backend setting `count` must be an integer ≥ 1 \(got 0\)"),
    ({"count": True}, r"`count` must be an integer ≥ 1 \(got True\)"),
    ({"rate": "fast"}, r"`rate` must be a number ≥ 0 \(got 'fast'\)"),
    ({"mode": "c"}, r"`mode` must be `a` or `b` \(got 'c'\)"),
    ({"path": 3}, r"`path` must be a string or a path \(got 3\)"),
    ({"options": ["x"]}, r"`options` must be a mapping \(got \['x'\]\)"),
    ({"api_token": 12345678}, r"`api_token` must be a string \(got a value\)"),  # a secret's name: never echoed
])
def test_mistakes_are_named_before_anything_starts(values, message):
    with pytest.raises(BackendError, match=message):
        ToyBackend(**values)


def test_the_builtin_backends_keep_their_call_forms():
    local = get_backend("local", max_parallel=2, gpus=[])
    assert isinstance(local, LocalBackend) and local.settings == LocalSettings(max_parallel=2) and local.gpus == []
    assert LocalBackend(LocalSettings(container=True), gpus=[]).capabilities.containers
    with pytest.raises(BackendError, match="use resources: for gpus, runs_per_gpu, max_parallel"):
        LocalBackend(runs_per_gpu=2)
    ray = pytest.importorskip("nbbatch.backends.ray")
    assert ray.RayBackend("10.0.0.4:6379", num_cpus=2).settings.address == "10.0.0.4:6379"
    assert ray.RayBackend(address="").settings.address == "auto"  # empty: Ray's own lookup
    assert ray.RayBackend(env={"A": 1}).settings.run_env == {"A": "1"}
    assert ray.RayBackend(poll_s=0).poll_s is None and ray.RayBackend(poll_s=2).poll_s == 2


# --- max_parallel: one rule on every backend ---------------------------------------------------------------

BUILTIN_BACKENDS = ["local", "slurm", "ray", "azureml", "kubernetes"]
REQUIRED = {"kubernetes": {"share": {"pvc": "results"}}}  # the settings a backend cannot be made without


def test_the_max_parallel_test_covers_every_builtin_backend():
    from nbbatch.backends import _BUILTIN

    assert sorted(_BUILTIN) == sorted(BUILTIN_BACKENDS)


@pytest.mark.parametrize("name", BUILTIN_BACKENDS)
@pytest.mark.parametrize(("experiment", "setting", "limit"), [
    (None, None, None),  # neither: as many as the compute has room for
    (3, None, 3),  # the experiment's resources.max_parallel
    (None, 3, 3),  # the backend's own max_parallel setting
    (3, 5, 3), (5, 3, 3),  # both: both are limits, the smaller wins
])
def test_the_same_experiment_gives_the_same_parallel_limit_on_every_backend(name, experiment, setting, limit):
    # the package (importable without them) needs its SDK
    extra = {"ray": "ray", "azureml": "azure.ai.ml", "kubernetes": "kubernetes"}.get(name)
    if extra:
        pytest.importorskip(extra)
    cls = backend_class(name)
    has_setting = "max_parallel" in cls.setting_table()
    if setting is not None and not has_setting:
        pytest.skip(f"{name} has no max_parallel setting of its own")
    backend = cls(**REQUIRED.get(name, {}), **({"max_parallel": setting} if has_setting else {}))
    assert backend.parallel_limit(SubmitOptions(max_parallel=experiment)) == limit
