"""`python -m node_host ...`: see node_host/main.py for the flags."""

from node_host.main import main

raise SystemExit(main())
