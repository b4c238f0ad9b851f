"""The triton backend's settings (backend.config of `backend.type: triton`), part of the ModelService
contract, so that a spec's admission refuses a wrong one naming its field (sie.engine_settings), and the
node host reads them with the same class when it writes the model repository
(node_host/backends/triton_server/repository.py).

    dynamic_batching     {max_queue_delay_microseconds: 0..1000000, preferred_batch_size: [sizes]}: Triton
                         gathers concurrent requests into one execute; off unless given
    instance_count       model instances (each a Python stub process), 1..64, default 1
    trusted_types, demo, seed   as for the sklearn backend (SklearnSettings)
max_batch_size is spec.batching.max_batch_size: the most rows one request or one execute may carry. Input
and output fields are scalars, one tensor column each (sie.engines.triton.DATATYPES).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sie.engine_settings.fields import WHERE, checked, shown
from sie.engine_settings.sklearn_engine import SklearnSettings
from sie.engines.triton import DATATYPES, input_fields, output_fields
from sie.errors import Problem
from sie.spec import FieldSpec, ModelService

MAX_QUEUE_DELAY_US = 1_000_000  # as spec.batching.max_delay_ms: at most a second
MAX_PREFERRED_SIZES = 16
MAX_INSTANCES = 64


@dataclass(frozen=True)
class DynamicBatching:
    max_queue_delay_microseconds: int = 0
    """How long Triton holds a request for others to batch with (µs); Triton's default, 0, batches only
    what is already waiting."""
    preferred_batch_size: tuple[int, ...] = ()
    """Batch sizes Triton prefers to run at once, each at most max_batch_size."""


@dataclass(frozen=True)
class TritonSettings:
    """The backend's settings, read once from the spec with errors that name the field. Pure: it belongs
    with the spec contract (sie.engine_settings), where the admission of a spec could check it too."""

    max_batch_size: int
    """spec.batching.max_batch_size: the most rows in one request and in one execute."""
    sklearn: SklearnSettings
    """trusted_types, demo and seed, read as the sklearn backend reads them."""
    instance_count: int = 1
    """backend.config.instance_count: model instances, each a Python stub process with its own estimator."""
    dynamic_batching: DynamicBatching | None = None
    """backend.config.dynamic_batching; None: off (each request is its own execute)."""

    @classmethod
    def from_spec(cls, service: ModelService) -> TritonSettings:
        return checked(
            *cls.read(service), service, "triton", "the path of a model file (.skops) or a Triton model directory"
        )

    @classmethod
    def read(cls, service: ModelService) -> tuple[TritonSettings, list[Problem]]:
        spec = service.spec
        config = spec.backend.config.model_extra or {}
        sklearn, problems = SklearnSettings.read(service)
        max_batch = spec.batching.max_batch_size
        count = config.get("instance_count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_INSTANCES:
            problems.append(
                Problem(WHERE + "instance_count", f"expected an integer from 1 to {MAX_INSTANCES}, got {shown(count)}")
            )
            count = 1
        batching = _dynamic_batching(config.get("dynamic_batching"), max_batch, problems)
        for i, spec_field in enumerate(input_fields(service)):
            problems += _field_problems(f"spec.input_schema.fields[{i}]", spec_field)
        for i, spec_field in enumerate(output_fields(service)):
            problems += _field_problems(f"spec.output_schema.fields[{i}]", spec_field)
        return cls(max_batch, sklearn, count, batching), problems


def _field_problems(where: str, spec: FieldSpec) -> list[Problem]:
    if spec.type in DATATYPES:
        return []
    return [
        Problem(
            f"{where}.type",
            f"{spec.name!r} is {spec.type}; the triton backend carries scalar fields only "
            f"({', '.join(DATATYPES)}), one tensor column each",
        )
    ]


def _dynamic_batching(value: Any, max_batch: int, problems: list[Problem]) -> DynamicBatching | None:
    where = WHERE + "dynamic_batching"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(
            Problem(
                where, f"expected a mapping (max_queue_delay_microseconds, preferred_batch_size), got {shown(value)}"
            )
        )
        return None
    unknown = sorted(str(k) for k in value if k not in ("max_queue_delay_microseconds", "preferred_batch_size"))
    if unknown:
        problems.append(
            Problem(
                where,
                f"unknown keys {', '.join(shown(k) for k in unknown[:5])}; it takes "
                "max_queue_delay_microseconds and preferred_batch_size",
            )
        )
    delay = value.get("max_queue_delay_microseconds", 0)
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= MAX_QUEUE_DELAY_US:
        problems.append(
            Problem(
                where + ".max_queue_delay_microseconds",
                f"expected an integer from 0 to {MAX_QUEUE_DELAY_US}, got {shown(delay)}",
            )
        )
        delay = 0
    sizes = value.get("preferred_batch_size", [])
    if (
        not isinstance(sizes, list)
        or len(sizes) > MAX_PREFERRED_SIZES
        or not all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= max_batch for s in sizes)
        or len(set(sizes)) != len(sizes)
    ):
        problems.append(
            Problem(
                where + ".preferred_batch_size",
                f"expected a list of at most {MAX_PREFERRED_SIZES} distinct sizes from 1 to {max_batch} "
                f"(spec.batching.max_batch_size), got {shown(sizes)}",
            )
        )
        sizes = []
    return DynamicBatching(delay, tuple(sorted(sizes)))
