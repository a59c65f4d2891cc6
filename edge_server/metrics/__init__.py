"""Prometheus metrics: collectors that read what the server already counts, when scraped, and the endpoint."""
