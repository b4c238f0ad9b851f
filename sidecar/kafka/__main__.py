"""`python -m sidecar.kafka ...`: the Kafka connector beside a worker; see sidecar/kafka/standalone.py for the flags."""

from sidecar.kafka.standalone import main

raise SystemExit(main())
