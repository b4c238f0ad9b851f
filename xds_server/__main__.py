"""`python -m xds_server ...`: see xds_server/settings.py for the flags."""

import sys

from xds_server.main import main

if __name__ == "__main__":
    sys.exit(main())
