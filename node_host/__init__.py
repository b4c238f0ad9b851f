"""The per-node agent: GPU inventory, memory ledger, placement and worker processes."""
