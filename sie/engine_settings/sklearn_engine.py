"""The sklearn engine's settings, read once from the ModelService (backend.config) with errors that name
the field. Unknown config keys are left alone: they may be meant for another engine (spec.py lets
engine arguments pass through)."""

from __future__ import annotations

from dataclasses import dataclass

from sie.engine_settings.fields import ConfigReader, checked
from sie.errors import Problem
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
    """backend.config.trusted_types: fully qualified type names skops may rebuild beyond its defaults; a
    file that needs any other is refused. skops calls a trusted type with arguments from the file, so a
    spec alone may list only scikit-learn's own classes; anything else (a function, another package's
    class) needs the node's --allow-unsafe-model-formats and a pinned model.sha256, as a pickle does
    (sie.model_files.spec_may_trust)."""
    fast_path: bool = True
    """backend.config.fast_path: score a binary LogisticRegression (alone, or behind a StandardScaler or
    a HashingVectorizer) with the node's fast linear form, without sklearn's per-call checks; False
    sends every call through the estimator's own predict_proba."""

    @classmethod
    def from_spec(cls, service: ModelService) -> SklearnSettings:
        """The settings, or SpecError naming every wrong field at once (a model path included: the
        engine needs one; a spec for an image of its own may go without)."""
        return checked(*cls.read(service), service, "sklearn", "the path of a model file (.skops)")

    @classmethod
    def read(cls, service: ModelService) -> tuple[SklearnSettings, list[Problem]]:
        """The settings (defaults where a value is wrong) and the problems of backend.config found."""
        spec = service.spec
        config = ConfigReader(spec.backend.config.model_extra or {})
        settings = cls(
            model_path=spec.model.path or "",
            served_model_name=service.model_id,
            demo=config.flag("demo", False),
            seed=config.integer("seed", 0, minimum=0, maximum=2**32 - 1),
            trusted_types=config.names("trusted_types", max_items=MAX_TRUSTED_TYPES, max_length=MAX_TYPE_NAME),
            fast_path=config.flag("fast_path", True),
        )
        return settings, config.problems
