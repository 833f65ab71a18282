"""The Grafana dashboard of pte-instrument, generated in code (``python -m grafana.generate``)."""
