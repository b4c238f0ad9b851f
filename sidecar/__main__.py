"""`python -m sidecar ...`: see sidecar/main.py and sidecar/settings.py for the flags."""

from sidecar.main import main

raise SystemExit(main())
