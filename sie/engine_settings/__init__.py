"""The embedded engines' settings (backend.config of the `sklearn` and `torch` backends), part of the
ModelService contract: the spec loader refuses a spec whose engine settings are wrong, naming each
field (so `sie validate`, the admin API and the Kubernetes controller answer with it), and each engine
reads its settings through the same classes when its worker starts.

    engine_settings_problems(service)  every wrong engine setting of a parsed spec, as Problems
    SklearnSettings, TorchSettings     the engines' settings (sklearn_engine.py, torch_engine.py)
    kv_budget                          the KV-budget scale the node host writes after repeated OOM kills
    sglang_args                        which SGLang arguments a spec may pass through (sie.model_files applies it)
    vllm_args                          the same for vLLM, and the vLLM keys SIE reads itself (kv_cache_mb,
                                       max_num_seqs), checked here

SGLang and vLLM check their own arguments when they start; the simulator's parameters are checked by the
node host before it admits an instance (node_host.backends.registry), as the simulator's model lives there.

Modules, each importing only those listed above it: fields.py (typed reads that collect Problems),
kv_budget.py, sklearn_engine.py, torch_engine.py; sglang_args.py imports kv_budget.py; vllm_args.py
imports fields.py, kv_budget.py and sglang_args.py (its flag spelling); triton_engine.py imports
fields.py, sklearn_engine.py and sie.engines.triton (its tensor types).
"""

from __future__ import annotations

from sie.engine_settings.fields import ConfigReader
from sie.engine_settings.kv_budget import KV_BUDGET_SCALE, kv_budget_scale
from sie.engine_settings.sklearn_engine import SklearnSettings
from sie.engine_settings.torch_engine import TorchSettings
from sie.engine_settings.triton_engine import TritonSettings
from sie.engine_settings.vllm_args import vllm_settings
from sie.errors import Problem
from sie.spec import BackendType, ModelService

__all__ = ["SklearnSettings", "TorchSettings", "engine_settings_problems"]


def engine_settings_problems(service: ModelService) -> list[Problem]:
    """Every wrong backend.config setting of `service` that its engine would refuse at start, each
    naming its field; empty when there is none. A missing model path is not one of them: SIE's worker
    needs it, but on Kubernetes a spec may name an image that serves the model itself."""
    backend = service.spec.backend.type
    if backend is BackendType.SKLEARN:
        return SklearnSettings.read(service)[1]
    if backend is BackendType.TORCH:
        return TorchSettings.read(service)[1]
    if backend is BackendType.VLLM:  # its pass-through flags are checked with the node's policy (sie.model_files)
        return vllm_settings(service)[1]
    if backend is BackendType.TRITON:
        return TritonSettings.read(service)[1] + _kafka_problems(service)
    # SGLang and the simulator keep a KV budget too: the scale is checked for them here, the rest of
    # their arguments where they are read.
    config = ConfigReader(service.spec.backend.config.model_extra or {})
    try:
        kv_budget_scale(config.config)
    except ValueError as exc:
        config.refuse(KV_BUDGET_SCALE, str(exc))
    return config.problems


def _kafka_problems(service: ModelService) -> list[Problem]:
    """The Kafka connector sends SIE's /infer JSON to the worker itself (sidecar/kafka), which an engine
    with a protocol of its own (Triton's KServe v2) does not take: refused rather than failing every batch."""
    if service.spec.kafka_input is None:
        return []
    return [
        Problem(
            "spec.kafka_input",
            f"the Kafka connector speaks SIE's /infer JSON to the worker, which the {service.spec.backend.type.value} "
            "backend does not take; serve this model's Kafka input with backend sklearn",
        )
    ]
