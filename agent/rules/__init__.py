"""Remediation: rule models and the pure evaluator (engine), and the actions that carry them out."""
