"""Every error `type` the product can answer is in the README's Errors table, so a client's list of
what to handle is complete. The types are read from the source: the first argument of every call that
builds an error body (error_body, error_bytes, InputError, the components' _error and _mapper helpers),
`kind = "..."` on exception classes, and the worker's class-to-type map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("sie", "xds_server", "sidecar", "node_host")
BUILDERS = {"error_body", "error_bytes", "InputError", "_error", "_mapper"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def product_types() -> dict[str, str]:
    found: dict[str, str] = {}
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                values: list[ast.expr] = []
                if isinstance(node, ast.Call) and _name(node.func) in BUILDERS:
                    values = [a for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)][:1]
                elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "kind" for t in node.targets
                ):
                    values = [node.value]
                elif (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "_KINDS" for t in node.targets)
                    and isinstance(node.value, ast.Dict)
                ):
                    values = list(node.value.values)
                for value in values:
                    if (
                        isinstance(value, ast.Constant)
                        and isinstance(value.value, str)
                        and re.fullmatch(r"[a-z][a-z0-9_]*", value.value)
                    ):
                        found.setdefault(value.value, str(path.relative_to(REPO)))
    return found


def readme_types() -> set[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", section))


def test_the_scan_finds_the_known_builders():
    types = product_types()
    assert {"invalid_json", "model_not_found", "overloaded", "worker_lost", "unauthenticated", "busy"} <= set(types)


def test_every_error_type_is_in_the_readme():
    missing = {kind: where for kind, where in product_types().items() if kind not in readme_types()}
    assert not missing, f"error types answered but not in README.md's Errors table: {missing}"
