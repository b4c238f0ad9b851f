"""CPU lists as taskset, cpuset and /proc spell them (`0`, `0-1`, `0,2`, `0-3,8-11`), and the node host's
tier-to-cores setting built on them (`gold=0-1,silver=2`). Pure; shared by the node host, the cluster
file, `sie join` and `sie status`.

    parse_cpu_list("0-2,5")            -> frozenset({0, 1, 2, 5})
    format_cpu_list({0, 1, 2, 5})      -> "0-2,5"
    parse_tier_cpus("gold=0-1,4;silver=2")  -> {"gold": frozenset({0, 1, 4}), "silver": frozenset({2})}

In a tier list, tiers are separated by `,` or `;`; an item without `=` continues the list of the tier
before it, so `gold=0,2` is gold on cores 0 and 2. Every ValueError says which item is wrong and why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MAX_CPU", "format_cpu_list", "parse_cpu_list", "parse_tier_cpus"]

# Linux's own bound on a CPU number (CONFIG_NR_CPUS is at most 8192); a typo like 10000 is refused here.
MAX_CPU = 8191
_TIER_NAME = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")


def _cpu(text: str, item: str) -> int:
    text = text.strip()
    if not (text.isascii() and text.isdigit()):  # not "²", which int() refuses
        raise ValueError(f"{item!r} is not a CPU number or range (e.g. 0, 0-1, 0,2)")
    value = int(text)
    if value > MAX_CPU:
        raise ValueError(f"CPU {value} in {item!r} is above {MAX_CPU}, Linux's largest CPU number")
    return value


def _add_item(cpus: set[int], item: str) -> None:
    low, dash, high = item.partition("-")
    if not dash:
        cpus.add(_cpu(low, item))
        return
    first, last = _cpu(low, item), _cpu(high, item)
    if first > last:
        raise ValueError(f"range {item!r} runs backwards; write it low-high")
    cpus.update(range(first, last + 1))


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-2,5' -> {0, 1, 2, 5}. An empty list is an error: a process needs at least one CPU."""
    cpus: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ValueError(f"{text!r} has an empty item; write CPUs as 0, 0-1 or 0,2")
        _add_item(cpus, item)
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (ranges where consecutive, ascending); '' for no CPUs."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_tier_cpus(text: str) -> dict[str, frozenset[int]]:
    """'gold=0-1,4;silver=2' -> {'gold': {0, 1, 4}, 'silver': {2}}; '' -> {}. A tier named twice, or an item
    before the first TIER=, is an error. Overlaps between tiers are the node host's check (node_host.cpus),
    which also knows which CPUs exist."""
    tiers: dict[str, set[int]] = {}
    current: str | None = None
    for item in (part.strip() for part in re.split(r"[,;]", text)):
        if not item:
            continue
        name, sep, cpus = item.partition("=")
        if sep:
            name = name.strip()
            if not _TIER_NAME.match(name):
                raise ValueError(f"{name!r} is not a tier name (letters, digits, '-', '_', '.'; at most 63)")
            if name in tiers:
                raise ValueError(f"tier {name!r} is given twice; list all its CPUs in one TIER=CPUS item")
            current, item = name, cpus.strip()
            tiers[name] = set()
            if not item:
                raise ValueError(f"tier {name!r} has no CPUs; write TIER=CPUS, e.g. {name}=0-1")
        elif current is None:
            raise ValueError(f"item {item!r} names no tier; write TIER=CPUS, e.g. 'gold=0-1,silver=2'")
        _add_item(tiers[current], item)
    return {name: frozenset(cpus) for name, cpus in tiers.items()}
