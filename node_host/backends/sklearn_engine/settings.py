"""The sklearn engine's settings, read once from the ModelService (backend.config) with errors that name
the field, as the torch engine's are. Unknown config keys are left alone: they may be meant for another
engine (spec.py lets engine arguments pass through)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sie.errors import Problem, SpecError
from sie.spec import ModelService

MAX_TRUSTED_TYPES = 256  # a spec lists the few types its estimator needs, not a catalogue
MAX_TYPE_NAME = 255  # characters in one fully qualified type name


@dataclass(frozen=True)
class SklearnSettings:
    model_path: str
    """spec.model.path: the estimator's file, under one of the node's model roots."""
    served_model_name: str
    """The model id the worker answers for."""
    demo: bool = False
    """backend.config.demo: train the demo text scorer at model_path (skops format) when no file is there."""
    seed: int = 0
    """backend.config.seed: the demo scorer's training seed (only with demo)."""
    trusted_types: tuple[str, ...] = ()
    """backend.config.trusted_types: fully qualified type names skops may rebuild beyond its defaults
    (scikit-learn, NumPy, SciPy); a file that needs any other is refused."""
    fast_path: bool = True
    """backend.config.fast_path: score a binary LogisticRegression (alone, or behind a StandardScaler or
    a HashingVectorizer) with fast_linear.py, without sklearn's per-call checks; False sends every call
    through the estimator's own predict_proba."""

    @classmethod
    def from_spec(cls, service: ModelService) -> SklearnSettings:
        spec = service.spec
        extra: dict[str, Any] = dict(spec.backend.config.model_extra or {})
        problems: list[Problem] = []
        where = "spec.backend.config."

        def flag(key: str, default: bool) -> bool:
            value = extra.get(key, default)
            if not isinstance(value, bool):
                problems.append(Problem(where + key, f"expected true or false, got {_shown(value)}"))
                return default
            return value

        if not spec.model.path:
            problems.append(Problem("spec.model.path", "the sklearn backend needs the path of a model file (.skops)"))
        seed = extra.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            problems.append(Problem(where + "seed", f"expected an integer from 0 to 2**32 - 1, got {_shown(seed)}"))
            seed = 0
        trusted = extra.get("trusted_types", [])
        if (
            not isinstance(trusted, list)
            or len(trusted) > MAX_TRUSTED_TYPES
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_TYPE_NAME for t in trusted)
        ):
            problems.append(
                Problem(
                    where + "trusted_types",
                    f"expected a list of at most {MAX_TRUSTED_TYPES} fully qualified type names "
                    f"(each 1 to {MAX_TYPE_NAME} characters), got {_shown(trusted)}",
                )
            )
            trusted = []
        settings = cls(
            model_path=spec.model.path or "",
            served_model_name=service.model_id,
            demo=flag("demo", False),
            seed=seed,
            trusted_types=tuple(trusted),
            fast_path=flag("fast_path", True),
        )
        if problems:
            raise SpecError(f"ModelService {service.model_id!r} (sklearn backend)", problems)
        return settings


def _shown(value: Any) -> str:
    """A value as an error shows it: its repr, cut to 64 characters (it came from outside)."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."
