"""A spec's `backend.requires` checked against what the node reports, before anything is started.

A ModelService may say `requires: ["cuda>=12.1", "sglang==0.5.*"]`. The node host reports its facts
(`node_host.gpus.node_facts()`: python, torch, cuda, sglang, vllm versions). A constraint whose name the
node does not report is unmet (the node cannot promise it), and so is a version outside the specifier.
Every unmet constraint yields one sentence that says what was asked, what the node has, and how to fix
it, so a refusal is a diagnosis rather than a runtime crash an hour later.

Pure: strings in, strings out. Names compare case-insensitively with `-`/`_`/`.` folded (PEP 503), so
`SGLang>=0.5` and `sglang>=0.5` are the same constraint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

_FOLD = re.compile(r"[-_.]+")


def normalise_name(name: str) -> str:
    return _FOLD.sub("-", name).lower()


def unmet_requirements(requires: Iterable[str], facts: Mapping[str, str | None]) -> tuple[str, ...]:
    """One reason per constraint in `requires` that the node's `facts` do not satisfy; empty when all hold."""
    known = {normalise_name(k): v for k, v in facts.items() if v not in (None, "")}
    reasons: list[str] = []
    for raw in requires:
        try:
            req = Requirement(raw)
        except InvalidRequirement as exc:
            reasons.append(f"{raw!r} is not a version constraint like 'cuda>=12.1' ({exc})")
            continue
        name = normalise_name(req.name)
        have = known.get(name)
        if have is None:
            reported = ", ".join(f"{k} {v}" for k, v in sorted(known.items())) or "nothing"
            reasons.append(
                f"the spec requires {raw!r} but the node does not report {req.name} "
                f"(it reports {reported}); install {req.name} on the node or drop the constraint"
            )
            continue
        if not req.specifier:
            continue  # a bare name only asks that the component be present
        try:
            version = Version(have)
        except InvalidVersion:
            reasons.append(
                f"the spec requires {raw!r} but the node reports {req.name} as {have!r}, which is not a version"
            )
            continue
        if not req.specifier.contains(version, prereleases=True):
            reasons.append(
                f"the spec requires {raw!r} but the node has {req.name} {have}; "
                f"run it on a node with {req.name}{req.specifier} or relax backend.requires"
            )
    return tuple(reasons)
