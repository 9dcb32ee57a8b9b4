"""SLO-driven autoscaling for DecodeService (`autoscaling.mode: builtin`).

`types` is the vocabulary shared by the I/O side (scraping each ready pod's proxy `/metrics`, writing
replicas, status and Events) and the pure decision side (windowed signals from histogram deltas, the
recommendation, stabilization and panic). The simulation benchmark drives the same decision code.
"""
