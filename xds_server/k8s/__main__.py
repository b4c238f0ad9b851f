"""`python -m xds_server.k8s`: see xds_server/k8s/main.py."""

import sys

from xds_server.k8s.main import main

if __name__ == "__main__":
    sys.exit(main())
