"""Everything about a configured inference service: managers, probes, scraping, latency, cause, attribution, export."""
