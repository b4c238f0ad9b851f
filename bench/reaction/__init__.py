"""bench.reaction: control-loop reaction time, from an instance's drain or slowdown to Envoy holding its
new health or weight, at 10 and 1000 registered endpoints (`python -m bench.reaction`, see main.py).

- `main`: the benchmark's composition root: flags, one setup per scale, results JSON, table and plot.
- `procs`: the processes of one setup (plane, fleet, sim worker + sidecar pairs): start, read, stop.
- `plane`: `python -m bench.reaction.plane`, a real xds_server that also writes a timeline.
- `fleet`: `python -m bench.reaction.fleet`, fake sidecars and node hosts posting like real ones.
- `trials`: make one event happen, wait until Envoy shows it, split the time by the timeline.
- `envoy_admin`: Envoy's admin view of one model's endpoints, polled while a trial waits.
- `plane_profile`: an optional py-spy sample of where the control plane's CPU goes.
- `report`: the figures (pure): percentiles, the time split, the judged line, the plot.
"""
