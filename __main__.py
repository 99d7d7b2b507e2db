"""Placeholder until the Pulumi program lands (issue 2)."""
