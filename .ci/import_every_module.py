"""Import every module of the installed SIE product, in a venv that has only its runtime dependencies.

Run by .ci/check_wheel inside that venv (never from the checkout: the working directory is elsewhere,
so only the wheel's files can be imported). A module that needs a test-only package, or test code,
fails here. Exits 1 naming each module that does not import.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

PACKAGES = ("sie", "xds_server", "sidecar", "node_host")


def main() -> int:
    failed: list[str] = []
    count = 0
    for top in PACKAGES:
        package = importlib.import_module(top)
        if "site-packages" not in (package.__file__ or ""):
            print(f"{top} imported from {package.__file__}, not from the installed wheel", file=sys.stderr)
            return 1
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{top}."):
            if info.name.endswith(".__main__"):
                continue  # running it is not importing it
            count += 1
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - report every failure, not the first
                failed.append(info.name)
                traceback.print_exc()
    for top in ("sie_testing", "bench", "tests"):
        try:
            importlib.import_module(top)
        except ImportError:
            continue
        failed.append(f"{top} (test code shipped in the wheel)")
    if failed:
        print(
            "these modules do not import with only the runtime dependencies:\n  " + "\n  ".join(failed), file=sys.stderr
        )
        return 1
    print(f"all {count} product modules import with only the runtime dependencies")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
