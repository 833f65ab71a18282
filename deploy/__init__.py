"""What pte-instrument ships for a deployment beside the plugin: the Prometheus rule file,
Kubernetes manifests and an OpenTelemetry Collector configuration, generated
(``python -m deploy.generate``) from ``prometheus/rules.py`` and ``deploy/manifests.py``."""
