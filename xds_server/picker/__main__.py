from xds_server.picker.server import main

raise SystemExit(main())
