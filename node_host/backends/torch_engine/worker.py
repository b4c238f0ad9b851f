"""The torch worker process: a Hugging Face causal LM behind the worker protocol.

    python -m node_host.backends.torch_engine --spec-file SPEC.json --host 127.0.0.1 --port PORT

backend.config keys: max_total_tokens, max_running_requests, max_prefill_tokens, seed, device, dtype,
num_threads (default 1: workers share the node's cores), demo (create a tiny random model at
model.path when nothing is there). See settings.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from node_host.backends.runtime.main import run_worker
from sie import model_files
from sie.engine_settings import TorchSettings
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService


def build_engine(service: ModelService, files: ModelFilePolicy):
    import torch
    from transformers.utils import logging as hf_logging

    from node_host.backends.torch_engine.engine import TorchEngine

    model_files.check_spec(service, files)
    settings = TorchSettings.from_spec(service)
    torch.set_num_threads(settings.num_threads)
    hf_logging.disable_progress_bar()  # progress bars are noise in a log file
    return TorchEngine(settings, files)


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(build_engine, argv, description="SIE torch worker (Hugging Face causal LM)")
