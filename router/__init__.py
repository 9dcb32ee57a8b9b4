"""The fleet router (`decodectl router`): one OpenAI-compatible front for a service's pods.

It picks a pod's proxy per request by prefix affinity, load and the service's TTFT objective
(docs/routing.md), sheds at the edge when no pod can meet the objective, and holds requests while the
service has no ready pod (scale from zero). Metrics: router/METRICS.md.
"""
